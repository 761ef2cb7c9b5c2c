// Vision towers, the LLaVA connector and the LLaVA loader (include/unirl/models/vision/): the
// fixtures of tests/fixtures/vlm (written by make_llava_fixture.py with the official safetensors
// package) loaded in both tensor layouts and checked against the vision features, projector
// outputs and last hidden states of the independent PyTorch implementation (CLIP and SigLIP,
// images of the configured and of smaller sizes); packed images against each image alone;
// activation checkpointing against the plain backward; the save/load round trip; config and load
// errors.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/io/safetensors.hpp>
#include <unirl/models/vision/llava.hpp>

#include "fixture_files.hpp"

using namespace unirl;
namespace vision = unirl::models::vision;
namespace hf = unirl::models::hf;
namespace fs = std::filesystem;

namespace {

fs::path fixtures() { return fs::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "vlm"; }

std::map<std::string, torch::Tensor> reference(const std::string& name) {
  return io::load_safetensors(fixtures() / (name + ".reference.safetensors"));
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  if (a.numel() == 0) return 0.0;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

using unirl_test::copy_dir;
using unirl_test::edit_config;
using unirl_test::temp_dir;
nlohmann::json read_json(const fs::path& file) {
  nlohmann::json j;
  std::ifstream(file) >> j;
  return j;
}

// A small CLIP tower in double precision with random weights (LayerNorms and biases perturbed).
vision::clip_vision random_tower(bool siglip, std::uint64_t seed) {
  torch::manual_seed(seed);
  auto c = vision::vision_config::defaults(siglip ? vision::vision_family::siglip : vision::vision_family::clip);
  c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 3, c.num_attention_heads = 2;
  c.image_size = 24, c.patch_size = 4;
  vision::clip_vision t(c);
  t->to(torch::kDouble);
  torch::NoGradGuard ng;
  for (auto& p : t->parameters()) p.add_(torch::randn_like(p) * 0.1);
  return t;
}

}  // namespace

TEST_CASE("vlm: LLaVA configs parse with Hugging Face's class defaults filled in and write back", "[cpu][vlm]") {
  const auto c = vision::llava_config::load(fixtures() / "llava_clip");
  CHECK(c.vision.family == vision::vision_family::clip);
  CHECK(c.vision.hidden_act == "quick_gelu");  // CLIPVisionConfig's default (absent from the file)
  CHECK(c.vision.layer_norm_eps == 1e-5);
  CHECK(c.vision.num_channels == 3);
  CHECK(c.vision.grid() == 4);
  CHECK(c.vision.extra.at("projection_dim") == 16);
  CHECK(c.text.arch == hf::architecture::llama);  // from text_config.model_type (no architectures)
  CHECK(c.text.hidden_size == 32);
  CHECK(c.text.num_key_value_heads == 2);
  CHECK(c.text.rope_theta == 10000.0);
  CHECK(c.image_token_index == 63);
  CHECK(c.vision_feature_layer == -2);
  CHECK(c.feature_layer_index() == 1);
  CHECK(c.vision_feature_select_strategy == vision::select_strategy::drop_first);
  CHECK(c.projector_hidden_act == "gelu");
  CHECK(c.extra.at("image_seq_length") == 16);
  const auto s = vision::llava_config::load(fixtures() / "llava_siglip" / "config.json");
  CHECK(s.vision.is_siglip());
  CHECK(s.vision.hidden_act == "gelu_pytorch_tanh");
  CHECK(s.vision.num_positions() == 9);
  CHECK(s.text.arch == hf::architecture::qwen2);
  CHECK(s.text.tie_word_embeddings);
  CHECK(s.vision_feature_select_strategy == vision::select_strategy::full);
  // Round trip through to_json.
  for (const auto* cfg : {&c, &s}) {
    const auto back = vision::llava_config::from_json(cfg->to_json());
    CHECK(back.to_json() == cfg->to_json());
    CHECK(back.text.to_json() == cfg->text.to_json());
  }
  // image_token_id (later transformers' spelling) is read too.
  auto j = c.to_json();
  j.erase("image_token_index");
  j["image_token_id"] = 60;
  CHECK(vision::llava_config::from_json(j).image_token_index == 60);

  const auto bad = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& expect) {
    auto x = c.to_json();
    edit(x);
    INFO(expect);
    CHECK_THROWS_WITH(vision::llava_config::from_json(x, "cfg.json"), Catch::Contains(expect) && Catch::Contains("cfg.json"));
  };
  bad([](auto& x) { x["vision_feature_select_strategy"] = "cls"; }, "vision_feature_select_strategy' = \"cls\"");
  bad([](auto& x) { x["vision_feature_layer"] = {-2, -5}; }, "a list of layers is not supported");
  bad([](auto& x) { x["vision_feature_layer"] = 3; }, "vision_feature_layer' = 3: expected in [-3, 2]");
  bad([](auto& x) { x["image_token_index"] = 64; }, "image_token_index' = 64: expected an id in [0, text_config.vocab_size = 64)");
  bad([](auto& x) { x["text_config"]["model_type"] = "mistral"; }, "text_config'.model_type = \"mistral\"");
  bad([](auto& x) { x["vision_config"]["model_type"] = "dinov2"; }, "model_type' = \"dinov2\": unsupported vision tower");
  bad([](auto& x) { x["vision_config"]["image_size"] = 30; }, "image_size' = 30: expected a multiple of patch_size = 8");
  bad([](auto& x) { x["vision_config"]["hidden_act"] = "swiglu"; }, "hidden_act' = \"swiglu\": unsupported");
  bad([](auto& x) { x["projector_hidden_act"] = "tanh"; }, "projector_hidden_act' = \"tanh\"");
  bad([](auto& x) { x.erase("vision_config"); }, "'vision_config' is missing");
  bad([](auto& x) { x["architectures"] = {"LlavaNextForConditionalGeneration"}; }, "LlavaNextForConditionalGeneration");
}

TEST_CASE("vlm: loaded CLIP and SigLIP towers and projectors equal the independent PyTorch implementation (fp32)",
          "[cpu][vlm]") {
  torch::NoGradGuard ng;
  for (const std::string name : {"llava_clip", "llava_siglip"}) {
    INFO(name);
    const auto m = vision::load_llava(fixtures() / name);
    CHECK(m.layout == (name == "llava_clip" ? vision::llava_layout::legacy : vision::llava_layout::current));
    const auto r = reference(name);
    const auto& c = m.config;
    const auto f = m.vision_tower->features(r.at("pixel_values"), c.vision_feature_layer, c.vision_feature_select_strategy);
    REQUIRE(f.scalar_type() == torch::kFloat);
    const auto df = max_diff(f, r.at("image_features"));
    const auto p = m.projector->forward(f);
    const auto dp = max_diff(p, r.at("projector_output"));
    const auto dl = max_diff(m.vision_tower->last_hidden_state(r.at("pixel_values")), r.at("last_hidden_state"));
    std::printf("vlm %-12s max |diff| features %.3g, projector %.3g, last_hidden_state %.3g (fp32)\n", name.c_str(), df,
                dp, dl);
    CHECK(df <= 1e-5);
    CHECK(dp <= 1e-5);
    CHECK(dl <= 1e-5);
    CHECK(m.projector->forward(r.at("image_features")).sizes() == r.at("projector_output").sizes());
    CHECK(max_diff(m.projector->forward(r.at("image_features")), r.at("projector_output")) <= 1e-5);
    // Smaller images: the configured grid's position embeddings at the same (row, column).
    std::vector<torch::Tensor> imgs, refs;
    for (int i = 0; r.count("pixel_values_small" + std::to_string(i)); ++i) {
      const auto px = r.at("pixel_values_small" + std::to_string(i));
      const auto want = r.at("image_features_small" + std::to_string(i));
      const auto got = m.vision_tower->features(px, c.vision_feature_layer, c.vision_feature_select_strategy);
      CHECK(max_diff(got, want) <= 1e-5);
      CHECK(m.vision_tower->num_features(px.size(2), px.size(3), c.vision_feature_select_strategy) == want.size(1));
      imgs.push_back(px[0]);
      refs.push_back(want[0]);
    }
    // All images of the fixture in one packed call.
    imgs.push_back(r.at("pixel_values")[1]);
    refs.push_back(r.at("image_features")[1]);
    const auto packed = m.vision_tower->features_packed(imgs, c.vision_feature_layer, c.vision_feature_select_strategy);
    CHECK(max_diff(packed, torch::cat(refs, 0)) <= 1e-5);
  }
  // Parameter names are Hugging Face's, one per checkpoint tensor (less the skipped ones).
  const auto m = vision::load_llava(fixtures() / "llava_clip");
  std::set<std::string> names;
  for (const auto& it : m.vision_tower->named_parameters()) names.insert(it.key());
  for (const auto* n : {"vision_model.embeddings.patch_embedding.weight", "vision_model.embeddings.class_embedding",
                        "vision_model.embeddings.position_embedding.weight", "vision_model.pre_layrnorm.weight",
                        "vision_model.encoder.layers.1.self_attn.out_proj.bias",
                        "vision_model.encoder.layers.0.mlp.fc1.weight", "vision_model.post_layernorm.bias"})
    CHECK(names.count(n) == 1);
  CHECK(names.count("vision_model.embeddings.patch_embedding.bias") == 0);  // CLIP: no bias
  const auto file = io::load_safetensors(fixtures() / "llava_clip" / "model.safetensors");
  CHECK(file.count("vision_tower.vision_model.embeddings.position_ids") == 1);  // stored, skipped
  CHECK(names.size() + m.projector->named_parameters().size() + m.language_model.named_parameters().size() ==
        file.size() - 1);
}

TEST_CASE("vlm: images of different sizes packed in one sequence, or of one size batched, equal each image alone (fp64)", "[cpu][vlm]") {
  torch::NoGradGuard ng;
  for (const bool siglip : {false, true}) {
    INFO((siglip ? "siglip" : "clip"));
    auto tower = random_tower(siglip, 3);
    const std::vector<torch::Tensor> imgs{torch::randn({3, 24, 24}, torch::kDouble),
                                          torch::randn({3, 8, 20}, torch::kDouble),
                                          torch::randn({3, 16, 4}, torch::kDouble)};
    for (const auto strategy : {vision::select_strategy::drop_first, vision::select_strategy::full})
      for (const std::int64_t layer : {-2, -1, 0, 2}) {
        std::vector<torch::Tensor> alone;
        for (const auto& im : imgs) alone.push_back(tower->features(im.unsqueeze(0), layer, strategy)[0]);
        const auto packed = tower->features_packed(imgs, layer, strategy);
        const auto want = torch::cat(alone, 0);
        REQUIRE(packed.sizes() == want.sizes());
        CHECK(max_diff(packed, want) <= 1e-10);
      }
    // Images all of one size run as one batch (no block-diagonal mask): the same features.
    const std::vector<torch::Tensor> same{torch::randn({3, 16, 12}, torch::kDouble), torch::randn({3, 16, 12}, torch::kDouble),
                                          torch::randn({3, 16, 12}, torch::kDouble)};
    for (const auto strategy : {vision::select_strategy::drop_first, vision::select_strategy::full})
      for (const std::int64_t layer : {-2, 0, 2}) {
        std::vector<torch::Tensor> alone;
        for (const auto& im : same) alone.push_back(tower->features(im.unsqueeze(0), layer, strategy)[0]);
        const auto want = torch::cat(alone, 0);
        const auto batched = tower->features_packed(same, layer, strategy);
        REQUIRE(batched.sizes() == want.sizes());
        CHECK(max_diff(batched, want) <= 1e-10);
      }
    std::int64_t n = 0;
    for (const auto& im : imgs) n += tower->num_features(im.size(1), im.size(2));
    CHECK(tower->features_packed(imgs).size(0) == n);
    // The same image twice in one batch: both rows equal the image alone.
    const auto two = tower->features(torch::stack({imgs[0], imgs[0]}), -2);
    CHECK(max_diff(two[1], tower->features(imgs[0].unsqueeze(0), -2)[0]) <= 1e-10);
  }
  // Bad images are errors naming them.
  auto tower = random_tower(false, 4);
  CHECK_THROWS_WITH(tower->features(torch::randn({1, 1, 24, 24}, torch::kDouble)),
                    Catch::Contains("1 channels: expected num_channels = 3"));
  CHECK_THROWS_WITH(tower->features(torch::randn({1, 3, 28, 24}, torch::kDouble)),
                    Catch::Contains("28 x 24 pixels: expected multiples of patch_size = 4 from 4 to image_size = 24"));
  CHECK_THROWS_WITH(tower->features(torch::randn({1, 3, 10, 24}, torch::kDouble)), Catch::Contains("10 x 24 pixels"));
  CHECK_THROWS_WITH(tower->features(torch::randn({3, 24, 24}, torch::kDouble)), Catch::Contains("(B, C, H, W)"));
  CHECK_THROWS_WITH(tower->features(torch::randn({1, 3, 24, 24}, torch::kDouble), 4),
                    Catch::Contains("feature layer 4: expected in [-4, 3]"));
  CHECK_THROWS_WITH(tower->features_packed({torch::randn({3, 24, 24}), torch::randn({2, 3, 8, 8})}),
                    Catch::Contains("image 1 must be (C, H, W) or (1, C, H, W)"));
  CHECK_THROWS_WITH(tower->features_packed({}), Catch::Contains("no images"));
}

TEST_CASE("vlm: activation checkpointing of the vision tower gives the plain gradients (fp64)", "[cpu][vlm]") {
  for (const bool siglip : {false, true}) {
    INFO((siglip ? "siglip" : "clip"));
    auto tower = random_tower(siglip, 5);
    auto proj = vision::llava_projector(16, 12);
    proj->to(torch::kDouble);
    const std::vector<torch::Tensor> imgs{torch::randn({3, 24, 24}, torch::kDouble),
                                          torch::randn({3, 12, 8}, torch::kDouble)};
    const auto batch = torch::randn({2, 3, 16, 16}, torch::kDouble);
    const auto run = [&](bool ckpt) {
      tower->set_checkpointing(ckpt ? std::vector<std::string>{"vision_tower"} : std::vector<std::string>{});
      CHECK(tower->checkpoint_layers() == ckpt);
      tower->zero_grad();
      proj->zero_grad();
      auto px = imgs[1].clone().requires_grad_(true);
      const auto a = proj->forward(tower->features_packed({imgs[0], px}, -1));
      const auto b = proj->forward(tower->features(batch, -2, vision::select_strategy::full));
      ((a * a).sum() + (b.sin()).sum()).backward();
      std::vector<torch::Tensor> grads{px.grad().clone()};
      // post_layernorm is not on the features' path: no gradient (undefined) either way.
      for (const auto& p : tower->parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros({0}));
      for (const auto& p : proj->parameters()) grads.push_back(p.grad().clone());
      // The last layer's output is a checkpointed block's (recomputed in the backward) or not.
      const auto last = tower->features(batch, -1, vision::select_strategy::full);
      const auto node = last.grad_fn() ? last.grad_fn()->name() : std::string("none");
      CHECK((node.find("checkpoint") != std::string::npos) == ckpt);
      return std::make_pair(grads, a.detach());
    };
    const auto [plain, out_plain] = run(false);
    const auto [ckpt, out_ckpt] = run(true);
    CHECK(max_diff(out_plain, out_ckpt) == 0.0);
    REQUIRE(plain.size() == ckpt.size());
    double worst = 0;
    for (std::size_t i = 0; i < plain.size(); ++i) worst = std::max(worst, max_diff(plain[i], ckpt[i]));
    CHECK(worst <= 1e-10);
    CHECK(plain[0].abs().sum().item<double>() > 0);  // gradients reach the pixels
  }
  auto tower = random_tower(false, 6);
  CHECK(tower->checkpointing_kinds() == std::vector<std::string>{"vision_tower"});
  CHECK_THROWS_AS(tower->set_checkpointing({"decoder_blocks"}), config_error);
  CHECK_THROWS_WITH(tower->set_checkpointing({"decoder_blocks"}), Catch::Contains("\"decoder_blocks\""));
  // A clone keeps the weights, not the storage.
  auto copy = std::dynamic_pointer_cast<vision::clip_vision_impl>(tower->clone());
  const auto px = torch::randn({1, 3, 24, 24}, torch::kDouble);
  torch::NoGradGuard ng;
  CHECK(max_diff(copy->features(px), tower->features(px)) == 0.0);
  CHECK(copy->parameters()[0].data_ptr() != tower->parameters()[0].data_ptr());
}

TEST_CASE("vlm: save_llava writes the layout it read, and load_llava reads it back unchanged", "[cpu][vlm]") {
  torch::NoGradGuard ng;
  for (const std::string name : {"llava_clip", "llava_siglip"}) {
    INFO(name);
    temp_dir tmp;
    const auto m = vision::load_llava(fixtures() / name);
    vision::save_llava(m, tmp.path / "same");
    const auto orig = io::load_safetensors(fixtures() / name / "model.safetensors");
    const auto saved = io::load_safetensors(tmp.path / "same" / "model.safetensors");
    // The same tensors under the same names (less the position_ids buffer and SigLIP's head).
    std::size_t skipped = 0;
    for (const auto& [k, v] : orig) {
      if (k.ends_with(".position_ids") || k.find("vision_model.head.") != std::string::npos) {
        ++skipped;
        CHECK(saved.count(k) == 0);
        continue;
      }
      INFO(k);
      REQUIRE(saved.count(k) == 1);
      CHECK(torch::equal(saved.at(k), v));
    }
    CHECK(saved.size() + skipped == orig.size());
    // config.json: every key of the original with the same value (defaults written out besides).
    const auto oj = read_json(fixtures() / name / "config.json");
    const auto sj = read_json(tmp.path / "same" / "config.json");
    for (const auto& key : {"image_token_index", "vision_feature_layer", "vision_feature_select_strategy",
                            "projector_hidden_act", "torch_dtype", "image_seq_length"})
      CHECK(sj.at(key) == oj.at(key));
    for (const auto& part : {"vision_config", "text_config"})
      for (auto it = oj.at(part).begin(); it != oj.at(part).end(); ++it) {
        if (it.key() == "use_sliding_window") continue;  // hf::decoder_config accepts only false and omits it
        INFO(part << "." << it.key());
        CHECK(sj.at(part).at(it.key()) == it.value());
      }
    // The other layout, read back: the same outputs.
    const auto other = m.layout == vision::llava_layout::legacy ? vision::llava_layout::current : vision::llava_layout::legacy;
    vision::save_llava(m, tmp.path / "other", {.layout = other});
    const auto names = io::load_safetensors(tmp.path / "other" / "model.safetensors");
    const std::string vis = other == vision::llava_layout::current ? "model.vision_tower." : "vision_tower.";
    CHECK(names.count(vis + "vision_model.post_layernorm.weight") == 1);
    CHECK(names.count(other == vision::llava_layout::current ? "model.language_model.norm.weight"
                                                             : "language_model.model.norm.weight") == 1);
    const auto back = vision::load_llava(tmp.path / "other");
    CHECK(back.layout == other);
    const auto r = reference(name);
    const auto& c = back.config;
    const auto f = back.vision_tower->features(r.at("pixel_values"), c.vision_feature_layer, c.vision_feature_select_strategy);
    CHECK(max_diff(back.projector->forward(f), r.at("projector_output")) <= 1e-5);
    const auto ids = torch::randint(0, 63, {2, 7});
    const auto mask = torch::ones({2, 7});
    CHECK(max_diff(back.language_model.logits(ids, mask), m.language_model.logits(ids, mask)) == 0.0);
    // bfloat16 on request: config and tensors say so.
    vision::save_llava(m, tmp.path / "bf16", {.dtype = hf::weight_dtype::bfloat16});
    CHECK(read_json(tmp.path / "bf16" / "config.json").at("torch_dtype") == "bfloat16");
    const auto b16 = vision::load_llava(tmp.path / "bf16", {.dtype = hf::weight_dtype::as_config});
    CHECK(b16.vision_tower->parameters()[0].scalar_type() == torch::kBFloat16);
    CHECK(b16.projector->parameters()[0].scalar_type() == torch::kBFloat16);
    CHECK(b16.language_model.dtype() == torch::kBFloat16);
    const auto fb = b16.vision_tower->features(r.at("pixel_values"), c.vision_feature_layer, c.vision_feature_select_strategy);
    CHECK(fb.scalar_type() == torch::kBFloat16);
    CHECK(max_diff(fb, r.at("image_features")) <= 0.1 * r.at("image_features").abs().max().item<double>());
  }
}

TEST_CASE("vlm: save_llava merges LoRA adapters, shards, copies tokenizer files", "[cpu][vlm]") {
  temp_dir tmp;
  auto m = vision::load_llava(fixtures() / "llava_clip");
  const auto adapted = lora::apply(*m.vision_tower.ptr(), {.rank = 2, .alpha = 4});
  CHECK(std::find(adapted.begin(), adapted.end(), "vision_model.encoder.layers.0.self_attn.q_proj") != adapted.end());
  lora::apply(*m.projector.ptr(), {.rank = 2, .alpha = 4});
  {
    torch::NoGradGuard ng;  // B starts at zero: make the adapters change the outputs
    for (auto* part : {static_cast<torch::nn::Module*>(m.vision_tower.ptr().get()),
                       static_cast<torch::nn::Module*>(m.projector.ptr().get())})
      for (auto& p : part->named_parameters())
        if (p.key().ends_with("lora_B.weight")) p.value().normal_(0.0, 0.5);
  }
  const auto r = reference("llava_clip");
  const auto px = r.at("pixel_values");
  torch::NoGradGuard ng;
  const auto want = m.projector->forward(m.vision_tower->features(px));
  CHECK(max_diff(want, r.at("projector_output")) > 1e-3);  // the adapters matter
  {
    std::ofstream(tmp.path / "tokenizer.json") << "{}";
  }
  vision::save_llava(m, tmp.path / "out", {.copy_tokenizer_from = tmp.path.string(), .max_shard_bytes = 100'000});
  CHECK(fs::is_regular_file(tmp.path / "out" / "tokenizer.json"));
  CHECK(fs::is_regular_file(tmp.path / "out" / "model.safetensors.index.json"));
  CHECK(!fs::exists(tmp.path / "out" / "model.safetensors"));
  const auto index = read_json(tmp.path / "out" / "model.safetensors.index.json");
  CHECK(index.at("weight_map").contains("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"));
  for (auto it = index.at("weight_map").begin(); it != index.at("weight_map").end(); ++it)
    CHECK(it.key().find("lora_") == std::string::npos);
  const auto back = vision::load_llava(tmp.path / "out");
  CHECK(max_diff(back.projector->forward(back.vision_tower->features(px)), want) <= 1e-5);
}

TEST_CASE("vlm: load_llava errors name the tensor and the file", "[cpu][vlm]") {
  temp_dir tmp;
  const auto src = fixtures() / "llava_clip";
  const auto rewrite = [&](const fs::path& d, const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
    copy_dir(src, d);
    auto t = io::load_safetensors(d / "model.safetensors");
    std::map<std::string, torch::Tensor> owned;
    for (const auto& [k, v] : t) owned.emplace(k, v.clone());
    t.clear();
    edit(owned);
    io::save_safetensors(d / "model.safetensors", {owned.begin(), owned.end()});
  };
  {
    const auto d = tmp.path / "broken";
    rewrite(d, [](auto& t) {
      t.erase("vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight");
      t.emplace("multi_modal_projector.linear_3.weight", torch::zeros({2, 2}));
      t["language_model.model.norm.weight"] = torch::ones({31});
    });
    try {
      (void)vision::load_llava(d);
      FAIL("expected an error");
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("3 problems") != std::string::npos);
      CHECK(msg.find("'vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight': missing") != std::string::npos);
      CHECK(msg.find("'multi_modal_projector.linear_3.weight'") != std::string::npos);
      CHECK(msg.find("unexpected") != std::string::npos);
      CHECK(msg.find("'language_model.model.norm.weight'") != std::string::npos);
      CHECK(msg.find("shape [31]") != std::string::npos);
      CHECK(msg.find("model.safetensors") != std::string::npos);
    }
  }
  {
    const auto d = tmp.path / "ints";
    rewrite(d, [](auto& t) { t["multi_modal_projector.linear_1.bias"] = torch::zeros({32}, torch::kInt32); });
    CHECK_THROWS_WITH(vision::load_llava(d), Catch::Contains("multi_modal_projector.linear_1.bias") &&
                                                 Catch::Contains("expected a floating-point dtype"));
  }
  {
    const auto d = tmp.path / "config";
    copy_dir(src, d);
    edit_config(d, [](auto& j) { j["vision_config"]["num_hidden_layers"] = 3; });
    CHECK_THROWS_WITH(vision::load_llava(d), Catch::Contains("vision_tower.vision_model.encoder.layers.2.") &&
                                                 Catch::Contains("missing"));
  }
  CHECK_THROWS_WITH(vision::load_llava(tmp.path / "nope"), Catch::Contains("is not a directory"));
  CHECK_THROWS_WITH(vision::load_llava(src, {.device = "gpu"}), Catch::Contains("device = \"gpu\""));
}

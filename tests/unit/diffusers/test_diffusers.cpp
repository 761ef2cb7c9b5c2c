// Stable Diffusion 3 in the diffusers layout: the configs' key checks, every component (and the
// T5 encoder on tiny_t5/) against the outputs of tests/fixtures/diffusers/sd3_reference.py (an independent PyTorch implementation
// written from diffusers' and transformers' modelling code) on the tiny random pipeline
// tiny_sd3/, a full 4-step sampling run, the flow-track adapter (text-embedding cache, guidance,
// LoRA, checkpointing, Flow-GRPO and DiffusionNFT through the trainer) and the export back.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <regex>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include <torch/torch.h>
// After LibTorch: glog's CHECK must not shadow Catch's.
#include <catch2/catch.hpp>

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/diffusers/sd3.hpp>
#include <unirl/models/diffusers/t5_encoder.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

#include "config_errors.hpp"
#include "fixture_files.hpp"
#include "weights.hpp"

using namespace unirl;
namespace df = unirl::models::diffusers;

namespace {

std::filesystem::path fixture_dir() { return std::filesystem::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "diffusers"; }
std::filesystem::path pipeline_dir() { return fixture_dir() / "tiny_sd3"; }

const io::safetensors_checkpoint& reference() {
  static const io::safetensors_checkpoint r(fixture_dir() / "tiny_sd3.reference.safetensors");
  return r;
}
torch::Tensor expected(const std::string& name) { return reference().tensor(name).clone(); }

df::sd3_pipeline& pipeline() {
  static df::sd3_pipeline p = df::load_sd3(pipeline_dir());
  return p;
}

const std::vector<std::string> prompts{"a photo of a cat", "A thick   SEVEN, 7!", "",
                                       "the digit zero on the left, drawn thin and bold again"};

// float32 agreement: |got - want| <= 1e-5 * max(1, max |want|) everywhere.
void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  REQUIRE(got.sizes() == want.sizes());
  const auto scale = std::max(1.0, want.abs().max().item<double>());
  const auto diff = (got.to(torch::kFloat) - want.to(torch::kFloat)).abs().max().item<double>();
  INFO(what << ": max |diff| = " << diff << " at scale " << scale);
  CHECK(diff <= 1e-5 * scale);
}

using unirl_test::error_of;

nlohmann::json read(const std::filesystem::path& f) {
  nlohmann::json j;
  std::ifstream(f) >> j;
  return j;
}

using sd3_model = models::flow_model<df::sd3_net>;

sd3_model adapter(df::sd3_pipeline& p, std::shared_ptr<df::sd3_prompts> pr, double guidance) {
  return sd3_model(df::sd3_net(p.transformer, std::move(pr)), p.latent_shape(16, 16), {.guidance = guidance});
}

}  // namespace

TEST_CASE("diffusers configs: unknown and unsupported keys are errors naming the key", "[diffusers][cpu]") {
  auto t = read(pipeline_dir() / "transformer" / "config.json");
  CHECK_NOTHROW(df::sd3_transformer_config::from_json(t, "t"));
  auto bad = t;
  bad["use_magic"] = true;
  CHECK_THAT(error_of([&] { df::sd3_transformer_config::from_json(bad, "t"); }), Catch::Contains("'use_magic'"));
  bad = t;
  bad["qk_norm"] = "layer_norm";
  CHECK_THAT(error_of([&] { df::sd3_transformer_config::from_json(bad, "t"); }), Catch::Contains("'qk_norm'"));
  bad = t;
  bad["dual_attention_layers"] = {0};
  CHECK_THAT(error_of([&] { df::sd3_transformer_config::from_json(bad, "t"); }),
             Catch::Contains("'dual_attention_layers'"));
  bad = t;
  bad["_class_name"] = "FluxTransformer2DModel";
  CHECK_THAT(error_of([&] { df::sd3_transformer_config::from_json(bad, "t"); }), Catch::Contains("'_class_name'"));
  bad = t;
  bad.erase("num_layers");  // the default applies (diffusers' 18)
  CHECK(df::sd3_transformer_config::from_json(bad, "t").num_layers == 18);

  auto v = read(pipeline_dir() / "vae" / "config.json");
  CHECK(df::autoencoder_kl_config::from_json(v, "v").shift_factor == Approx(0.0609));
  auto bv = v;
  bv["act_fn"] = "relu";
  CHECK_THAT(error_of([&] { df::autoencoder_kl_config::from_json(bv, "v"); }), Catch::Contains("'act_fn'"));
  bv = v;
  bv["down_block_types"] = {"DownEncoderBlock2D", "AttnDownEncoderBlock2D"};
  CHECK_THAT(error_of([&] { df::autoencoder_kl_config::from_json(bv, "v"); }), Catch::Contains("AttnDownEncoderBlock2D"));

  auto s = read(pipeline_dir() / "scheduler" / "scheduler_config.json");
  auto bs = s;
  bs["use_dynamic_shifting"] = true;
  CHECK_THAT(error_of([&] { df::flow_match_scheduler_config::from_json(bs, "s"); }),
             Catch::Contains("'use_dynamic_shifting'"));
  auto c = read(pipeline_dir() / "text_encoder" / "config.json");
  c["hidden_act"] = "silu";
  CHECK_THAT(error_of([&] { df::clip_text_config::from_json(c, "c"); }), Catch::Contains("'hidden_act'"));

  // A pipeline naming a T5 encoder is refused unless run without it.
  unirl_test::temp_dir tmp;
  std::filesystem::copy(pipeline_dir(), tmp.path / "p", std::filesystem::copy_options::recursive);
  auto idx = read(tmp.path / "p" / "model_index.json");
  idx["text_encoder_3"] = {"transformers", "T5EncoderModel"};
  std::ofstream(tmp.path / "p" / "model_index.json") << idx.dump();
  CHECK_THAT(error_of([&] { df::load_sd3(tmp.path / "p"); }), Catch::Contains("'text_encoder_3'"));
  CHECK_NOTHROW(df::load_sd3(tmp.path / "p", {.allow_missing_t5 = true}));
  // A tensor missing from a shard is named.
  std::filesystem::remove(tmp.path / "p" / "vae" / "diffusion_pytorch_model-00002-of-00002.safetensors");
  CHECK_THAT(error_of([&] { df::load_sd3(tmp.path / "p", {.allow_missing_t5 = true}); }),
             Catch::Contains("diffusion_pytorch_model-00002-of-00002.safetensors"));
}

TEST_CASE("CLIP tokenizers and text encoders equal the reference", "[diffusers][cpu]") {
  auto& p = pipeline();
  CHECK(torch::equal(p.tokenizer.encode_batch(prompts), expected("ids_1")));
  CHECK(torch::equal(p.tokenizer_2.encode_batch(prompts), expected("ids_2")));  // pads with "!"
  torch::NoGradGuard ng;
  const auto [h1, p1] = p.text_encoder->encode(expected("ids_1"));
  check_close(h1, expected("te1_penultimate"), "text_encoder hidden_states[-2]");
  check_close(p1, expected("te1_pooled"), "text_encoder text_embeds");
  const auto [h2, p2] = p.text_encoder_2->encode(expected("ids_2"));
  check_close(h2, expected("te2_penultimate"), "text_encoder_2 hidden_states[-2]");
  check_close(p2, expected("te2_pooled"), "text_encoder_2 text_embeds");
  const auto [ctx, pooled] = p.encode_prompts(prompts);
  check_close(ctx, expected("prompt_embeds"), "prompt_embeds (CLIP-L | CLIP-G, padded; zero T5 tokens)");
  check_close(pooled, expected("pooled_embeds"), "pooled_prompt_embeds");
  // The id range is checked with one counted read, and an id past the vocabulary is named.
  const auto reads = unirl::host_reads();
  (void)p.text_encoder->encode(expected("ids_1"));
  CHECK(unirl::host_reads() - reads == 1);
  const auto vocab = p.text_encoder->config().vocab_size;
  CHECK_THAT(error_of([&] { (void)p.text_encoder->encode(torch::tensor({{std::int64_t{0}, vocab}}, torch::kInt64)); }),
             Catch::Contains("token ids in [0, " + std::to_string(vocab) + "]"));
}

TEST_CASE("SD3 transformer equals the reference (square and wide latents)", "[diffusers][cpu]") {
  auto& p = pipeline();
  torch::NoGradGuard ng;
  check_close(p.transformer->forward(expected("dit_x"), expected("dit_t"), expected("dit_ctx"), expected("dit_pooled")), expected("dit_out"),
              "transformer 8x8");
  check_close(p.transformer->forward(expected("dit_x_wide"), expected("dit_t"), expected("dit_ctx"), expected("dit_pooled")),
              expected("dit_out_wide"), "transformer 8x12");
  // The sin-cos table a config alone builds equals the checkpoint's pos_embed.pos_embed.
  df::sd3_transformer fresh(p.transformer->config());
  const io::safetensors_checkpoint ck(pipeline_dir() / "transformer" / "diffusion_pytorch_model.safetensors");
  check_close(fresh->pos_embed->pos_embed, ck.tensor("pos_embed.pos_embed"), "sin-cos position table");
  // Diffusers' names, one for one.
  std::set<std::string> names;
  for (const auto& t : df::detail::targets_of(*p.transformer)) names.insert(t.first);
  const auto listed = ck.names();
  const std::set<std::string> file(listed.begin(), listed.end());
  CHECK(names == file);
}

TEST_CASE("AutoencoderKL encode / decode equal the reference", "[diffusers][cpu]") {
  auto& p = pipeline();
  torch::NoGradGuard ng;
  const auto [mean, logvar] = p.vae->encode(expected("vae_images"));
  check_close(mean, expected("vae_mean"), "vae latent mean");
  check_close(logvar, expected("vae_logvar"), "vae latent logvar");
  check_close(p.vae->decode(expected("vae_latents")), expected("vae_decoded"), "vae decode");
  check_close(p.vae->decode_latents(expected("vae_latents")), expected("vae_decoded_scaled"), "vae decode(z / scale + shift)");
  check_close(p.vae->encode_latents(expected("vae_images")), (expected("vae_mean") - 0.0609) * 1.5305, "encode_latents");
}

TEST_CASE("FlowMatchEulerDiscreteScheduler sigmas and a full 4-step run equal the reference", "[diffusers][cpu]") {
  auto& p = pipeline();
  for (int n : {1, 4, 28}) {
    check_close(p.scheduler.sigmas(n), expected("sigmas_" + std::to_string(n)), "sigmas");
    check_close(p.scheduler.timesteps(n), expected("timesteps_" + std::to_string(n)), "timesteps");
  }
  const std::vector<std::string> two(prompts.begin(), prompts.begin() + 2);
  const auto lat = p.generate(two, expected("run_noise"), {.steps = 4, .guidance = 4.0});
  check_close(lat, expected("run_latents"), "4-step latents, guidance 4");
  torch::NoGradGuard ng;
  check_close(p.vae->decode_latents(lat), expected("run_images"), "4-step images");
  check_close(p.generate(two, expected("run_noise"), {.steps = 4, .guidance = 1.0}), expected("run_latents_noguide"),
              "4-step latents, no guidance");
}

// bf16: unit roundoff u = 2^-8. A forward of D stages applied one after another (each linear,
// conv, norm, attention product or residual sum rounds its result to bf16, after weights and
// inputs were rounded) can be off the float32 result by about D u of the largest value when the
// roundings add up; the bound checked is D u max(1, max |want|), with D counted per component:
// an MMDiT block 12 (AdaLN linear, norm, q/k/v, RMS norm, scores, weighted sum, out, residual,
// norm + modulation, two MLP linears, residual), the embeddings 5, the output 3; a CLIP layer 15
// (layer norm, q/k/v, scaled scores, the causal mask's sum, softmax, weighted sum, out_proj,
// residual, layer norm, fc1, quick_gelu's three: 1.702 x, sigmoid, product; fc2, residual — the
// count was 11, without the mask, softmax and quick_gelu's inner two, and an AMD EPYC measured
// 13.8 u at 12), the embeddings 1, the pooled head 2; the VAE decoder's ResNet 7, attention 6, up-sampling 1,
// conv_in 1 and the output 3. And it ran in bf16: the error is above float32's 1e-5.
TEST_CASE("bf16: SD3 components with bfloat16 weights equal the float32 reference within D u", "[diffusers][cpu]") {
  auto p = df::load_sd3(pipeline_dir(), {.dtype = torch::kBFloat16});
  REQUIRE(p.transformer->proj_out->weight.scalar_type() == torch::kBFloat16);
  REQUIRE(p.vae->parameters().front().scalar_type() == torch::kBFloat16);
  REQUIRE(p.text_encoder_2->parameters().front().scalar_type() == torch::kBFloat16);
  const double u = std::ldexp(1.0, -8);
  const auto check_bf16 = [&](const torch::Tensor& got, const torch::Tensor& want, double depth, const char* what) {
    REQUIRE(got.scalar_type() == torch::kBFloat16);
    const auto scale = std::max(1.0, want.abs().max().item<double>());
    const auto diff = (got.to(torch::kFloat) - want).abs().max().item<double>();
    std::printf("bf16 %-28s max |diff| %.3g at scale %.3g: %.3g u of the scale (bound D u, D = %g)\n", what, diff, scale,
                diff / (u * scale), depth);
    INFO(what << ": max |diff| = " << diff << ", bound " << depth * u * scale);
    CHECK(diff <= depth * u * scale);
    CHECK(diff > 1e-5 * scale);
  };
  torch::NoGradGuard ng;
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  const auto layers = [](const auto& c) { return static_cast<double>(c.num_hidden_layers); };
  const double dit = 12.0 * static_cast<double>(p.transformer->config().num_layers) + 8.0;
  check_bf16(p.transformer->forward(bf(expected("dit_x")), expected("dit_t"), bf(expected("dit_ctx")), bf(expected("dit_pooled"))),
             expected("dit_out"), dit, "transformer 8x8");
  const auto& c1 = p.text_encoder->config();
  const auto [h1, p1] = p.text_encoder->encode(expected("ids_1"));
  check_bf16(h1, expected("te1_penultimate"), 15.0 * (layers(c1) - 1) + 1, "text_encoder hidden_states[-2]");
  check_bf16(p1, expected("te1_pooled"), 15.0 * layers(c1) + 3, "text_encoder text_embeds");
  const auto [h2, p2] = p.text_encoder_2->encode(expected("ids_2"));
  check_bf16(p2, expected("te2_pooled"), 15.0 * layers(p.text_encoder_2->config()) + 3, "text_encoder_2 text_embeds");
  // Decoder: conv_in, mid block (ResNet, attention, ResNet), per stage layers_per_block + 1
  // ResNets and an up-sampling conv (none after the last), then norm, SiLU, conv_out.
  const auto& vc = p.vae->config();
  const auto stages = static_cast<double>(vc.block_out_channels.size());
  const double dec = 1 + (7 + 6 + 7) + stages * 7.0 * static_cast<double>(vc.layers_per_block + 1) + (stages - 1) + 3;
  check_bf16(p.vae->decode(bf(expected("vae_latents"))), expected("vae_decoded"), dec, "vae decode");
  const auto lat = p.generate({prompts[0], prompts[1]}, expected("run_noise"), {.steps = 4, .guidance = 4.0});
  const auto want = expected("run_latents");
  const auto scale = std::max(1.0, want.abs().max().item<double>());
  const auto diff = (lat - want).abs().max().item<double>();
  // Guided velocities u + w (c - u) carry (|1 - w| + w) times a forward's error; the Euler
  // steps' dt add up to 1 (accumulated in float32).
  const double w = 4.0, run_bound = (std::abs(1.0 - w) + w) * dit * u * scale;
  std::printf("bf16 4-step run (guidance 4)       max |diff| %.3g at scale %.3g: %.3g u of the scale (bound (|1-w|+w) D u)\n",
              diff, scale, diff / (u * scale));
  CHECK(diff <= run_bound);
  CHECK(diff > 1e-5 * scale);
}

TEST_CASE("T5 encoder (text_encoder_3) equals the reference; its config keys are checked", "[diffusers][cpu]") {
  const auto dir = fixture_dir() / "tiny_t5";
  const io::safetensors_checkpoint r(fixture_dir() / "tiny_t5.reference.safetensors");
  auto t5 = df::load_t5_encoder(dir);
  CHECK(t5->config().gated);
  CHECK(t5->encoder->block->size() == 3);
  torch::NoGradGuard ng;
  // Row 0 spans 14 tokens: relative distances in both the exact and the logarithmic buckets.
  check_close(t5->forward(r.tensor("ids")), r.tensor("last_hidden_state"), "T5 last_hidden_state");
  // Diffusers' / transformers' names, one for one.
  const io::safetensors_checkpoint ck(dir / "model.safetensors");
  std::set<std::string> names;
  for (const auto& p : t5->named_parameters()) names.insert(p.key());
  const auto listed = ck.names();
  CHECK(names == std::set<std::string>(listed.begin(), listed.end()));
  CHECK_THAT(error_of([&] { (void)t5->forward(torch::tensor({{1, 64}}, torch::kInt64)); }), Catch::Contains("[1, 64]"));

  const auto c = read(dir / "config.json");
  auto bad = c;
  bad["feed_forward_proj"] = "gated-silu";
  CHECK_THAT(error_of([&] { df::t5_encoder_config::from_json(bad, "t"); }), Catch::Contains("'feed_forward_proj'"));
  bad = c;
  bad["is_gated_act"] = false;
  CHECK_THAT(error_of([&] { df::t5_encoder_config::from_json(bad, "t"); }), Catch::Contains("'is_gated_act'"));
  bad = c;
  bad["use_magic"] = 1;
  CHECK_THAT(error_of([&] { df::t5_encoder_config::from_json(bad, "t"); }), Catch::Contains("'use_magic'"));
}

TEST_CASE("sd3 flow adapter: guided velocity, one text encoding per prompt, LoRA off = base", "[diffusers][cpu]") {
  auto p = df::load_sd3(pipeline_dir());
  auto pr = std::make_shared<df::sd3_prompts>(p, std::vector<std::string>{"a photo of a cat", "A thick   SEVEN, 7!"});
  auto model = adapter(p, pr, 4.0);
  static_assert(VelocityModel<sd3_model> && ModelAdapter<sd3_model>);
  static_assert(AlgorithmFor<algo::flow_grpo<>, sd3_model> && AlgorithmFor<algo::flow_dppo<sde::cps>, sd3_model> &&
                AlgorithmFor<algo::ram<>, sd3_model> && AlgorithmFor<algo::diffusion_nft<>, sd3_model>);
  const auto x = expected("dit_x");
  const auto cond = torch::tensor({0, 1}, torch::kInt64);
  torch::Tensor v;
  {
    torch::NoGradGuard ng;
    v = model.velocity(x, torch::full({2}, 0.25), cond);
    // By hand: the transformer at t = 250 for each prompt and for the empty one, guided.
    const auto [ctx, pooled] = p.encode_prompts({"a photo of a cat", "A thick   SEVEN, 7!"});
    const auto [nctx, npooled] = p.encode_prompts({"", ""});
    const auto t = torch::full({2}, 250.0f);
    const auto c = p.transformer->forward(x, t, ctx, pooled), u = p.transformer->forward(x, t, nctx, npooled);
    check_close(v, u + 4.0 * (c - u), "guided velocity");
  }
  CHECK(pr->encoder_calls() == 1);   // both prompts and the empty one in one batch
  CHECK(pr->encoded_prompts() == 3);
  // A whole Flow-GRPO rollout (3 steps, guidance: 6 transformer calls of 2 + 2 rows) adds none.
  const auto b = sample_trajectory(sde::flow_grpo({.steps = 3}), model, torch::tensor({1, 0, 1}, torch::kInt64));
  CHECK(b.samples().sizes() == torch::IntArrayRef({3, 4, 8, 8}));
  // The other velocity samplers run on it too, each replaying its own steps exactly.
  const auto three = torch::tensor({0, 1, 0}, torch::kInt64);
  const auto replays = [&](const auto& sampler) {
    const auto r = sample_trajectory(sampler, model, three);
    torch::NoGradGuard ng;
    for (std::int64_t k = 0; k < r.steps(); ++k)
      CHECK(torch::equal(replay_step(sampler, model, r, k).log_prob, r.log_probs.select(1, k)));
    CHECK(torch::isfinite(r.samples()).all().item().toBool());
  };
  replays(sde::cps({.steps = 3}));
  replays(sde::dance({.steps = 3}));
  replays(ode::euler({.steps = 3, .shift = 3.0}));
  CHECK(pr->encoder_calls() == 1);

  // A clone (the frozen reference of full fine-tuning) has its own transformer with the same
  // weights: the same velocity, and untouched when the original's weights change.
  {
    torch::NoGradGuard ng;
    auto copy = model.clone();
    CHECK(copy.net()->transformer.ptr() != model.net()->transformer.ptr());
    CHECK(torch::equal(copy.velocity(x, torch::full({2}, 0.25), cond), v));
    const auto w = model.net()->transformer->proj_out->weight.clone();
    model.net()->transformer->proj_out->weight.add_(1.0);
    CHECK(torch::equal(copy.velocity(x, torch::full({2}, 0.25), cond), v));
    model.net()->transformer->proj_out->weight.copy_(w);
  }

  // LoRA on the attention and MLP linears only: the reference (adapters off) is the base exactly.
  const auto adapted = lora::apply(*model.net(), {.rank = 4, .alpha = 8, .targets = df::sd3_lora_targets()});
  CHECK(adapted.size() == 12 + 9);  // block 0: 8 attention + 2 x 2 MLP; the last block: no to_add_out, no ff_context
  for (const auto& name : adapted) CHECK(name.rfind("transformer.transformer_blocks.", 0) == 0);
  {
    torch::NoGradGuard ng;
    for (auto& [name, m] : lora::adapted_modules(*model.net())) lora::detail::factors_of(*m).second->weight.normal_();
    const auto with = model.velocity(x, torch::full({2}, 0.25), cond);
    CHECK((with - v).abs().max().item<double>() > 1e-3);
    lora::disabled_guard off;
    CHECK(torch::equal(model.velocity(x, torch::full({2}, 0.25), cond), v));
  }
}

TEST_CASE("sd3 prompts: each prompt's embedding is its fixed group's batch, whatever the request order", "[diffusers][cpu]") {
  const auto p = df::load_sd3(pipeline_dir());
  const std::vector<std::string> texts{"a photo of a cat", "A thick   SEVEN, 7!", "the digit zero", "a red cube", "two"};
  df::sd3_prompts a(p, texts, 2), b(p, texts, 2);  // groups by position: {"", 0}, {1, 2}, {3, 4}
  const auto cpu = torch::Device(torch::kCPU);
  const auto ids = [](std::initializer_list<std::int64_t> v) { return torch::tensor(std::vector<std::int64_t>(v)); };
  a.embeddings(ids({3}), cpu);
  a.embeddings(ids({0, -1}), cpu);
  const auto [ca, pa] = a.embeddings(ids({4, 1, 2, -1, 0, 3}), cpu);
  const auto [cb, pb] = b.embeddings(ids({4, 1, 2, -1, 0, 3}), cpu);
  CHECK(a.encoder_calls() == 3);  // one batch per group, in either order
  CHECK(b.encoder_calls() == 3);
  CHECK(a.encoded_prompts() == 6);
  CHECK((torch::equal(ca, cb) && torch::equal(pa, pb)));
  // Each row is what its group's batch gives, bit for bit.
  const auto [g2, q2] = p.encode_prompts({texts[1], texts[2]});
  const auto [g3, q3] = p.encode_prompts({texts[3], texts[4]});
  const auto [g0, q0] = p.encode_prompts({"", texts[0]});
  CHECK((torch::equal(ca[0], g3[1]) && torch::equal(ca[1], g2[0]) && torch::equal(ca[2], g2[1])));
  CHECK((torch::equal(ca[3], g0[0]) && torch::equal(ca[4], g0[1]) && torch::equal(ca[5], g3[0])));
  CHECK((torch::equal(pa[0], q3[1]) && torch::equal(pa[3], q0[0])));
  CHECK_THAT(error_of([&] { df::sd3_prompts(p, texts, 0); }), Catch::Contains("group 0"));
  CHECK_THAT(error_of([&] { b.embeddings(ids({5}), cpu); }), Catch::Contains("condition 5"));
}

TEST_CASE("sd3 adapter: checkpointed blocks give the same gradients", "[diffusers][cpu]") {
  auto p = df::load_sd3(pipeline_dir());
  auto pr = std::make_shared<df::sd3_prompts>(p, std::vector<std::string>{"a photo of a cat"});
  auto model = adapter(p, pr, 1.0);
  auto grads = [&] {
    model.net()->zero_grad();
    torch::manual_seed(3);
    model.flow_matching_loss(torch::randn({2, 4, 8, 8}), torch::zeros({2}, torch::kInt64)).backward();
    std::vector<torch::Tensor> g;
    for (const auto& q : model.net()->parameters()) g.push_back(q.grad().clone());
    return g;
  };
  const auto plain = grads();
  model.net()->set_checkpointing({"flow_blocks"});
  const auto recomputed = grads();
  REQUIRE(plain.size() == recomputed.size());
  // Equal up to the order of float32 sums: the gradient of temb (read by every block) accumulates
  // its blocks' parts in another order when they are recomputed.
  for (std::size_t i = 0; i < plain.size(); ++i) {
    const auto scale = std::max(1e-3, plain[i].abs().max().item<double>());
    INFO("parameter " << i << ": max |diff| " << (plain[i] - recomputed[i]).abs().max().item<double>() << " at scale "
                      << scale);
    CHECK((plain[i] - recomputed[i]).abs().max().item<double>() <= 1e-5 * scale);
  }
}

namespace {
// Mean brightness of the VAE-decoded images: the reward reads pixels, not latents.
struct brightness {
  df::sd3_pipeline* pipe;
  torch::Tensor operator()(const flow_rollout& b) {
    torch::NoGradGuard ng;
    return pipe->vae->decode_latents(b.samples().to(torch::kFloat)).flatten(1).mean(1);
  }
};

template <class Algo>
std::vector<double> train_losses(df::sd3_pipeline& p, typename Algo::options o, int steps) {
  auto pr = std::make_shared<df::sd3_prompts>(p, std::vector<std::string>{"a photo of a cat", "the digit zero"});
  auto model = adapter(p, pr, 2.0);
  lora::apply(*model.net(), {.rank = 4, .alpha = 8, .targets = df::sd3_lora_targets()});
  auto base_weights = [&] {
    std::vector<torch::Tensor> w;
    for (const auto& q : p.transformer->named_parameters())
      if (q.key().find("lora_") == std::string::npos) w.push_back(q.value().detach().clone());
    return w;
  };
  const auto base = base_weights();
  trainer<sd3_model, Algo, brightness> t(std::move(model), brightness{&p},
                                         {.algorithm = o, .optim = {.lr = 1e-2}, .group_size = 2, .seed = 1,
                                          .progress = false});
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(t.step(torch::tensor({0, 1}, torch::kInt64)).loss);
  // Only the adapters trained; the pipeline's weights (shared by the net) are untouched.
  CHECK(unirl_test::all_equal(base, base_weights()));
  CHECK(pr->encoder_calls() == 1);
  return losses;
}
}  // namespace

TEST_CASE("Flow-GRPO and DiffusionNFT train the SD3 transformer through LoRA", "[diffusers][cpu]") {
  auto check = [](const std::vector<double>& l) {
    for (double x : l) CHECK(std::isfinite(x));
    CHECK(l.front() != l.back());
  };
  SECTION("Flow-GRPO") {
    auto p = df::load_sd3(pipeline_dir());
    const auto l = train_losses<algo::flow_grpo<>>(p, {.beta = 0.04, .sampler = {.steps = 3}}, 3);
    INFO("losses " << l[0] << " " << l[1] << " " << l[2]);
    check(l);
  }
  SECTION("DiffusionNFT") {
    auto p = df::load_sd3(pipeline_dir());
    const auto l = train_losses<algo::diffusion_nft<>>(p, {.sampler = {.steps = 3}}, 3);
    INFO("losses " << l[0] << " " << l[1] << " " << l[2]);
    check(l);
  }
}

TEST_CASE("export: the transformer and the pipeline (single files or shards) reload bit-identical, the LoRA alone in diffusers' names",
          "[diffusers][cpu]") {
  auto p = df::load_sd3(pipeline_dir());
  unirl_test::temp_dir tmp;
  df::save_sd3(p, tmp.path / "sd3");
  auto q = df::load_sd3(tmp.path / "sd3");
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.transformer), unirl_test::parameter_copies(*q.transformer)));
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.vae), unirl_test::parameter_copies(*q.vae)));
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.text_encoder_2),
                              unirl_test::parameter_copies(*q.text_encoder_2)));
  const std::vector<std::string> two(prompts.begin(), prompts.begin() + 2);
  CHECK(torch::equal(p.generate(two, expected("run_noise"), {.steps = 4, .guidance = 4.0}),
                     q.generate(two, expected("run_noise"), {.steps = 4, .guidance = 4.0})));

  // Sharded: every component above 20 kB in shards + index (diffusion_pytorch_model-0000i-of-0000n
  // / model-0000i-of-0000n), read back bit-identical; no single file beside them.
  df::save_sd3(p, tmp.path / "sharded", {.max_shard_bytes = 20'000});
  for (const auto& [comp, stem] : std::vector<std::pair<std::string, std::string>>{
           {"transformer", "diffusion_pytorch_model"}, {"vae", "diffusion_pytorch_model"},
           {"text_encoder", "model"}, {"text_encoder_2", "model"}}) {
    const auto d = tmp.path / "sharded" / comp;
    INFO(comp);
    CHECK_FALSE(std::filesystem::exists(d / (stem + ".safetensors")));
    const auto index = read(d / (stem + ".safetensors.index.json"));
    std::set<std::string> files;
    for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
    CHECK(files.size() >= 2);
    for (const auto& f : files) {
      CHECK(std::regex_match(f, std::regex(stem + "-[0-9]{5}-of-[0-9]{5}\\.safetensors")));
      CHECK(std::filesystem::is_regular_file(d / f));
    }
  }
  auto sh = df::load_sd3(tmp.path / "sharded");
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.transformer), unirl_test::parameter_copies(*sh.transformer)));
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.vae), unirl_test::parameter_copies(*sh.vae)));
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.text_encoder), unirl_test::parameter_copies(*sh.text_encoder)));
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(*p.text_encoder_2),
                              unirl_test::parameter_copies(*sh.text_encoder_2)));
  // Saved again unsharded into the same folder: the shards and the index go.
  df::save_sd3(sh, tmp.path / "sharded");
  CHECK(std::filesystem::is_regular_file(tmp.path / "sharded" / "vae" / "diffusion_pytorch_model.safetensors"));
  CHECK_FALSE(std::filesystem::exists(tmp.path / "sharded" / "vae" / "diffusion_pytorch_model.safetensors.index.json"));
  if (const char* keep = std::getenv("UNIRL_DIFFUSERS_EXPORT"))  // for check_sharded.py
    df::save_sd3(p, std::filesystem::path(keep) / "sharded", {.max_shard_bytes = 20'000});

  // LoRA: trained factors out in diffusers' names, back in through load_lora: the same velocity.
  auto pr = std::make_shared<df::sd3_prompts>(p, std::vector<std::string>{"a photo of a cat"});
  auto model = adapter(p, pr, 3.0);
  lora::apply(*model.net(), {.rank = 2, .alpha = 6, .targets = df::sd3_lora_targets()});
  {
    torch::NoGradGuard ng;
    for (auto& [name, m] : lora::adapted_modules(*model.net())) lora::detail::factors_of(*m).second->weight.normal_(0, 0.1);
  }
  df::save_lora(*model.net(), tmp.path / "lora");
  const io::safetensors_checkpoint lf(tmp.path / "lora" / "pytorch_lora_weights.safetensors");
  CHECK(lf.contains("transformer.transformer_blocks.0.attn.to_q.lora_A.weight"));
  CHECK(lf.contains("transformer.transformer_blocks.1.ff.net.2.lora_B.weight"));
  CHECK(lf.contains("transformer.transformer_blocks.0.attn.to_add_out.lora_B.weight"));
  CHECK_FALSE(lf.contains("transformer.transformer_blocks.1.attn.to_add_out.lora_B.weight"));  // context_pre_only
  CHECK(lf.names().size() == 2 * df::sd3_lora_targets().size() * 2 - 2 * 3);
  CHECK(read(tmp.path / "lora" / "adapter_config.json")["r"] == 2);

  auto q2 = df::load_sd3(pipeline_dir());
  auto pr2 = std::make_shared<df::sd3_prompts>(q2, std::vector<std::string>{"a photo of a cat"});
  auto reloaded = adapter(q2, pr2, 3.0);
  df::load_lora(*reloaded.net(), tmp.path / "lora");
  torch::NoGradGuard ng;
  const auto x = expected("dit_x");
  const auto c = torch::zeros({2}, torch::kInt64);
  const auto t = torch::full({2}, 0.6);
  check_close(reloaded.velocity(x, t, c), model.velocity(x, t, c), "velocity with the reloaded LoRA");

  // The merged transformer (W + (alpha/r) B A) in the diffusers layout gives the adapted velocity.
  df::save_transformer(p.transformer, tmp.path / "merged");
  df::sd3_transformer merged(df::sd3_transformer_config::load(tmp.path / "merged"));
  df::detail::load_weights(*merged, tmp.path / "merged", "diffusion_pytorch_model");
  auto pr3 = std::make_shared<df::sd3_prompts>(p, std::vector<std::string>{"a photo of a cat"});
  sd3_model merged_model(df::sd3_net(merged, pr3), p.latent_shape(16, 16), {.guidance = 3.0});
  check_close(merged_model.velocity(x, t, c), model.velocity(x, t, c), "velocity of the merged export");
  // For tests/fixtures/diffusers/check_lora.py (the names against the independent implementation).
  if (const char* keep = std::getenv("UNIRL_DIFFUSERS_EXPORT")) {
    std::filesystem::copy(tmp.path / "lora", std::filesystem::path(keep) / "lora",
                          std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
    std::filesystem::copy(tmp.path / "merged", std::filesystem::path(keep) / "merged",
                          std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  }
}

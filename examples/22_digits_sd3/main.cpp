// Stable Diffusion 3's architecture on the real 8x8 digits, in and out of the diffusers layout.
//
// 1. A digit classifier is trained on the digits (the reward; the model never sees it).
// 2. A small SD3 is built: an AutoencoderKL (1 channel, 8x8 -> 4 x 4 x 4 latents) trained on the
//    digits, two CLIP text encoders (random, frozen) with a character-level CLIP tokenizer, and an
//    SD3Transformer2DModel (3 MMDiT blocks, width 32, RMS q/k norms) trained by flow matching on
//    the prompts "a digit zero" ... "a digit nine" (10% empty prompts, for guidance).
// 3. The pipeline is saved in the diffusers layout and loaded back (weights compared); a later
//    run with reuse=true (the default) starts from the saved folder.
// 4. Flow-GRPO through LoRA on the transformer's attention and MLP linears, on a reward the
//    model never saw: thick, legible digits — (1 - w) the classifier's probability that the
//    VAE-decoded sample shows the prompt's digit + w its ink (mean pixel); the reference is the
//    loaded model with the adapters off.
// 5. Before -> after: reward of ODE samples from fixed noise, path KL to the reference, sample
//    grids; the LoRA exported in diffusers' names, loaded onto a fresh copy of the saved
//    pipeline, gives the same samples.
//
//   digits_sd3 [--out DIR] [key=value ...]     e.g. steps=40 lr=2e-3 vae_iters=600
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <unirl/train/plot.hpp>  // first: brings the stb_image_write implementation

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/core/command_line.hpp>
#include <unirl/models/diffusers/sd3.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

#include "common/digits.hpp"
#include "common/flow_example.hpp"

namespace df = unirl::models::diffusers;

namespace {

struct example_options {
  std::int64_t vae_iters = 1500;       // AutoencoderKL training iterations
  std::int64_t pretrain_iters = 3000;  // flow-matching iterations of the transformer
  std::int64_t steps = 40;             // Flow-GRPO trainer steps
  std::int64_t conditions = 5;         // prompts per step (each drawn group_size times)
  std::int64_t group_size = 8;
  std::int64_t sampler_steps = 10;
  std::int64_t lora_rank = 8;
  double lr = 2e-3;                    // LoRA's learning rate
  double kl_beta = 0.01;
  double guidance = 1.0;
  double ink_weight = 0.5;             // reward = (1 - w) confidence + w ink
  bool reuse = true;                   // load <out>/sd3_digits when a previous run saved it
  std::int64_t seed = 1;
};

using flow_t = unirl::models::flow_model<df::sd3_net>;

const char* names[] = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};

std::vector<std::string> prompts() {
  std::vector<std::string> p;
  for (const char* n : names) p.push_back(std::string("a digit ") + n);
  return p;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A character-level CLIP vocabulary (the 256 byte symbols, the same with </w>, BOS, EOS; no
// merges) written as vocab.json + merges.txt + tokenizer_config.json.
void write_tokenizer(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  nlohmann::json vocab = nlohmann::json::object();
  std::int64_t id = 0;
  for (int b = 0; b < 256; ++b) vocab[unirl::tokenizers::detail::bytes_to_token(std::string(1, static_cast<char>(b)))] = id++;
  for (int b = 0; b < 256; ++b)
    vocab[unirl::tokenizers::detail::bytes_to_token(std::string(1, static_cast<char>(b))) + "</w>"] = id++;
  vocab["<|startoftext|>"] = id++;
  vocab["<|endoftext|>"] = id++;
  std::ofstream(dir / "vocab.json") << vocab.dump();
  std::ofstream(dir / "merges.txt") << "#version: 0.2\n";
  std::ofstream(dir / "tokenizer_config.json")
      << nlohmann::json{{"tokenizer_class", "CLIPTokenizer"}, {"model_max_length", 24}, {"pad_token", "<|endoftext|>"}}.dump(2);
}

df::clip_text_config text_config(std::int64_t hidden) {
  df::clip_text_config c;
  c.vocab_size = 514;
  c.hidden_size = hidden;
  c.intermediate_size = 2 * hidden;
  c.projection_dim = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.max_position_embeddings = 24;
  c.bos_token_id = 512;
  c.eos_token_id = 513;
  c.pad_token_id = 513;
  return c;
}

/// Trains the VAE on the digits (reconstruction + 1e-4 KL); returns it with scaling and shift
/// factors that make the latents of the digits zero-mean, unit-variance.
df::autoencoder_kl train_vae(const torch::Tensor& images, const example_options& opt) {
  df::autoencoder_kl_config c;
  c.in_channels = c.out_channels = 1;
  c.block_out_channels = {32, 64};
  c.layers_per_block = 1;
  c.latent_channels = 4;
  c.norm_num_groups = 8;
  c.sample_size = 8;
  c.scaling_factor = 1.0;
  c.shift_factor = 0.0;
  df::autoencoder_kl vae(c);
  torch::optim::Adam adam(vae->parameters(), torch::optim::AdamOptions(2e-3));
  const auto start = std::chrono::steady_clock::now();
  double last = 0;
  for (std::int64_t i = 0; i < opt.vae_iters; ++i) {
    const auto x = images.index_select(0, torch::randint(0, images.size(0), {128}, torch::kInt64));
    const auto [mean, logvar] = vae->encode(x);
    const auto z = mean + (0.5 * logvar).exp() * torch::randn_like(mean);
    const auto rec = (vae->decode(z) - x).pow(2).mean();
    const auto kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean();
    const auto loss = rec + 1e-4 * kl;
    adam.zero_grad();
    loss.backward();
    adam.step();
    last = rec.item<double>();
  }
  torch::NoGradGuard ng;
  const auto z = vae->encode(images).first;
  c.shift_factor = z.mean().item<double>();
  c.scaling_factor = 1.0 / z.std().item<double>();
  df::autoencoder_kl scaled(c);
  auto dst = scaled->named_parameters();
  for (const auto& p : vae->named_parameters()) dst[p.key()].copy_(p.value());
  std::cout << "VAE: " << opt.vae_iters << " iterations in " << seconds_since(start) << " s, reconstruction MSE "
            << last << ", scaling_factor " << c.scaling_factor << ", shift_factor " << c.shift_factor << "\n";
  return scaled;
}

/// The reward, on the VAE-decoded samples: (1 - w) p_classifier(class = the prompt's digit) +
/// w ink (the mean pixel in [0, 1]: thicker strokes), a style the prompts never asked for.
struct thick_and_legible {
  examples::digit_classifier clf;
  df::sd3_pipeline* pipe;
  double w = 0.5;
  std::pair<torch::Tensor, torch::Tensor> parts(const unirl::flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto img = pipe->vae->decode_latents(b.samples().to(torch::kFloat)).clamp(-1, 1);
    const auto p = torch::softmax(clf->forward(img), 1);
    return {p.gather(1, b.conditions.reshape({-1, 1}).to(torch::kInt64)).squeeze(1), ((img + 1) / 2).flatten(1).mean(1)};
  }
  torch::Tensor operator()(const unirl::flow_rollout& b) {
    const auto [conf, ink] = parts(b);
    return (1 - w) * conf + w * ink;
  }
};

struct evaluation {
  double reward = 0, confidence = 0, ink = 0, kl = 0;
  torch::Tensor images;  // (100, 8, 8): 10 per class, class-major
};

/// ODE samples (10 steps) from fixed noise, 10 per prompt: the reward, the images; and the path
/// KL of the Flow-GRPO SDE to the reference (the same model with the adapters off).
evaluation evaluate(flow_t& model, thick_and_legible& reward, df::sd3_pipeline& pipe) {
  torch::NoGradGuard ng;
  const examples::scoped_seed fixed(1234);
  evaluation e;
  const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(10);
  const auto noise = torch::randn({100, 4, 4, 4});
  const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 10}), model, labels, noise);
  e.reward = reward(b).mean().item<double>();
  const auto [conf, ink] = reward.parts(b);
  e.confidence = conf.mean().item<double>();
  e.ink = ink.mean().item<double>();
  e.images = pipe.vae->decode_latents(b.samples()).reshape({100, 8, 8});
  const unirl::sde::flow_grpo sde({.steps = 10, .reduction = unirl::logprob_reduction::sum});
  const auto path = unirl::sample_trajectory(sde, model, labels);
  auto kl = torch::zeros({100});
  {
    unirl::lora::disabled_guard off;
    for (std::int64_t k = 0; k < path.steps(); ++k) {
      const auto ref = unirl::replay_step(sde, model, path, k);
      kl += unirl::gaussian_kl(path.means.select(1, k), ref.step.mean, ref.step.std, unirl::logprob_reduction::sum);
    }
  }
  e.kl = kl.mean().item<double>();
  return e;
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, vae_iters, pretrain_iters, steps, conditions, group_size, sampler_steps,
                        lora_rank, lr, kl_beta, guidance, ink_weight, reuse, seed);

int main(int argc, char** argv) try {
  example_options opt;
  // --out DIR, --recipe FILE, key=value overrides; --help prints every option.
  const std::string out = unirl::options::parse_command_line(opt, argc, argv, {{"out", "runs/22_digits_sd3"}})["out"];
  std::filesystem::create_directories(out);
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));

  // 1. The classifier (the reward) and the data in [-1, 1].
  auto setup = examples::prepare_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));

  // 2. The pipeline, built and trained here (or the one a previous run saved, with reuse=true).
  const auto saved = std::filesystem::path(out) / "sd3_digits";
  if (opt.reuse && std::filesystem::exists(saved / "model_index.json")) {
    std::cout << "loading the pipeline a previous run trained and saved: " << saved.string() << "\n";
  } else {
    df::sd3_pipeline pipe;
    pipe.tokenizer_dir = std::filesystem::path(out) / "tokenizer_source";
    pipe.tokenizer_2_dir = pipe.tokenizer_dir;
    write_tokenizer(pipe.tokenizer_dir);
    pipe.tokenizer = pipe.tokenizer_2 = df::clip_tokenizer::from_dir(pipe.tokenizer_dir);
    pipe.text_encoder = df::clip_text_encoder(text_config(32));
    pipe.text_encoder_2 = df::clip_text_encoder(text_config(32));
    for (auto* m : {pipe.text_encoder.ptr().get(), pipe.text_encoder_2.ptr().get()})
      for (auto& p : m->parameters()) p.set_requires_grad(false);
    pipe.t5_tokens = 0;  // no T5: and no zero T5 tokens, for speed (loaded back with t5_tokens = 0)
    pipe.scheduler.config = {.num_train_timesteps = 1000, .shift = 1.0};
    pipe.vae = train_vae(setup.images, opt);
    for (auto& p : pipe.vae->parameters()) p.set_requires_grad(false);
    df::sd3_transformer_config tc;
    tc.sample_size = 4;
    tc.patch_size = 1;
    tc.in_channels = tc.out_channels = 4;
    tc.num_layers = 3;
    tc.attention_head_dim = 16;
    tc.num_attention_heads = 2;
    tc.joint_attention_dim = 64;
    tc.caption_projection_dim = 32;
    tc.pooled_projection_dim = 32;
    tc.pos_embed_max_size = 4;
    tc.qk_rms_norm = true;
    pipe.transformer = df::sd3_transformer(tc);
    {
      torch::Tensor latents;
      {
        torch::NoGradGuard ng;
        latents = pipe.vae->encode_latents(setup.images);
      }
      auto pr = std::make_shared<df::sd3_prompts>(pipe, prompts());
      flow_t model(df::sd3_net(pipe.transformer, pr), {4, 4, 4});
      torch::optim::AdamW adam(pipe.transformer->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
      const auto start = std::chrono::steady_clock::now();
      double first = 0, last = 0;
      for (std::int64_t i = 0; i < opt.pretrain_iters; ++i) {
        const auto idx = torch::randint(0, latents.size(0), {128}, torch::kInt64);
        const auto loss = model.flow_matching_loss(latents.index_select(0, idx), setup.labels.index_select(0, idx), 0.1);
        adam.zero_grad();
        loss.backward();
        adam.step();
        last = 0.98 * last + 0.02 * loss.item<double>();
        if (i == 0) first = last = loss.item<double>();
      }
      std::cout << "transformer: " << opt.pretrain_iters << " flow-matching iterations in " << seconds_since(start)
                << " s, loss " << first << " -> " << last << " (" << pr->encoder_calls() << " text-encoder batch)\n";
    }

    // 3. Out in the diffusers layout, and back.
    df::save_sd3(pipe, saved);
    auto back = df::load_sd3(saved, {.t5_tokens = 0});
    bool same = true;
    auto mine = pipe.transformer->named_parameters();
    for (const auto& p : back.transformer->named_parameters()) same = same && torch::equal(p.value(), mine[p.key()]);
    std::cout << "saved to " << saved.string() << " and loaded back: transformer weights "
              << (same ? "bit-identical" : "DIFFERENT") << "\n";
    UNIRL_CHECK(same, "the reloaded transformer differs from the saved one");
  }
  auto loaded = df::load_sd3(saved, {.t5_tokens = 0});

  // 4. Flow-GRPO through LoRA on the loaded pipeline.
  auto pr = std::make_shared<df::sd3_prompts>(loaded, prompts());
  flow_t policy(df::sd3_net(loaded.transformer, pr), {4, 4, 4}, {.guidance = opt.guidance});
  const auto adapted =
      unirl::lora::apply(*policy.net(), {.rank = opt.lora_rank, .alpha = 2.0 * static_cast<double>(opt.lora_rank),
                                         .targets = df::sd3_lora_targets()});
  using trainer_t = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, thick_and_legible>;
  trainer_t t(std::move(policy), thick_and_legible{setup.clf, &loaded, opt.ink_weight},
              {.algorithm = {.beta = opt.kl_beta, .sampler = {.steps = opt.sampler_steps}},
               .optim = {.lr = opt.lr},
               .clip = {.max_grad_norm = 1.0},
               .group_size = opt.group_size,
               .seed = opt.seed,
               .metrics_path = out + "/metrics.jsonl",
               .progress = true,
               .total_steps = opt.steps});
  std::cout << adapted.size() << " linears adapted (rank " << opt.lora_rank << ")\n";
  auto& model = t.models().policy;
  const auto before = evaluate(model, t.reward(), loaded);
  std::cout << "before: reward " << before.reward << " (confidence " << before.confidence << ", ink " << before.ink
            << ")\n";
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t s = 0; s < opt.steps; ++s)
    t.step(torch::randperm(10, torch::kInt64).slice(0, 0, std::min<std::int64_t>(opt.conditions, 10)));
  const double seconds = seconds_since(start);
  const auto after = evaluate(model, t.reward(), loaded);
  std::cout << "\nafter:  reward " << after.reward << " (confidence " << after.confidence << ", ink " << after.ink
            << ")  kl " << after.kl << "  (" << opt.steps << " steps, " << seconds
            << " s; " << pr->encoder_calls() << " text-encoder batches)\n";
  examples::write_grid_png(out + "/samples_before.png", before.images, 10, 10, 4);
  examples::write_grid_png(out + "/samples_after.png", after.images, 10, 10, 4);

  // 5. The LoRA alone, in diffusers' names, onto a fresh copy of the saved pipeline.
  df::save_lora(*model.net(), std::filesystem::path(out) / "lora");
  auto fresh = df::load_sd3(saved, {.t5_tokens = 0});
  auto pr2 = std::make_shared<df::sd3_prompts>(fresh, prompts());
  flow_t reloaded(df::sd3_net(fresh.transformer, pr2), {4, 4, 4}, {.guidance = opt.guidance});
  df::load_lora(*reloaded.net(), std::filesystem::path(out) / "lora");
  double diff = 0;
  {
    torch::NoGradGuard ng;
    const auto labels = torch::arange(10, torch::kInt64).repeat_interleave(10);
    const auto noise = torch::randn({100, 4, 4, 4});
    const auto a = unirl::sample_trajectory(unirl::ode::euler({.steps = 10}), model, labels, noise).samples();
    const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 10}), reloaded, labels, noise).samples();
    diff = (a - b).abs().max().item<double>();
  }
  std::cout << "reloaded LoRA: samples within " << diff << " of the trained policy's\n";
  UNIRL_CHECK(diff < 1e-4, "the reloaded LoRA gives other samples: max |diff| ", diff);

  std::ofstream(out + "/summary.json") << nlohmann::json{{"classifier_accuracy", setup.accuracy},
                                                         {"reward_before", before.reward},
                                                         {"reward_after", after.reward},
                                                         {"confidence_before", before.confidence},
                                                         {"confidence_after", after.confidence},
                                                         {"ink_before", before.ink},
                                                         {"ink_after", after.ink},
                                                         {"kl_after", after.kl},
                                                         {"steps", opt.steps},
                                                         {"seconds", seconds},
                                                         {"lora_reload_max_diff", diff},
                                                         {"encoder_batches", pr->encoder_calls()}}
                                              .dump(2)
                                       << "\n";
  std::cout << "outputs in " << out << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}

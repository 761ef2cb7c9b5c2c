// One Flow-GRPO step (LoRA) of a small Stable Diffusion 3 in the diffusers layout, per stage:
// text encoding, sampling, VAE decode, reward, update — time and the peak resident set of each,
// with and without the text-embedding cache and activation checkpointing. The same step in plain
// PyTorch: sd3_step_compare.py; both, side by side: compare_sd3_step.sh (docs/performance.md).
//
//   bench_sd3_step --save DIR --tokenizer TOKDIR   # writes the benchmark's pipeline (random weights, seed 0)
//   bench_sd3_step --model DIR [--cache 1] [--checkpointing 0] [--steps 3] [--threads 0]
//
// The configuration (docs/performance.md): an MMDiT of 4 blocks, width 128 (2 heads of 64), QK
// RMS norm, patch 2 on 16 x 16 x 16 latents (64 image tokens); 77 CLIP tokens (CLIP-L-like width
// 64, CLIP-G-like width 128, 2 layers each) + 77 zero T5 tokens of width 256; an AutoencoderKL
// (32, 32, 64, 64) decoding to 128 x 128 RGB; the Flow-GRPO SDE with 6 steps, guidance 4.5,
// 2 prompts x 4 samples, LoRA rank 8 on the attention and MLP linears, beta 0.04.
//
// Output: one JSON object per measured step (a warm-up step first), then the medians.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/models/diffusers/sd3.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/trainer.hpp>

namespace df = unirl::models::diffusers;
namespace fs = std::filesystem;

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

const std::vector<std::string> bench_prompts{"a photo of a cat", "a red cube on a blue table", "the digit seven",
                                             "a thick zero drawn in ink"};

df::clip_text_config clip_config(std::int64_t hidden) {
  df::clip_text_config c;
  c.vocab_size = 554;  // the fixture tokenizer's vocabulary
  c.hidden_size = hidden;
  c.intermediate_size = 4 * hidden;
  c.projection_dim = hidden;
  c.num_hidden_layers = 2;
  c.num_attention_heads = hidden / 32;
  c.max_position_embeddings = 77;
  c.bos_token_id = 552;
  c.eos_token_id = 553;
  c.pad_token_id = 1;
  return c;
}

// The benchmark's pipeline, random weights from seed 0, in the diffusers layout.
void save_pipeline(const fs::path& dir, const fs::path& tokenizer) {
  torch::manual_seed(0);
  df::sd3_pipeline p;
  for (const char* name : {"tokenizer", "tokenizer_2"}) {
    fs::create_directories(dir / name);
    for (const char* f : {"vocab.json", "merges.txt"})
      fs::copy_file(tokenizer / f, dir / name / f, fs::copy_options::overwrite_existing);
    std::ofstream(dir / name / "tokenizer_config.json")
        << nlohmann::json{{"tokenizer_class", "CLIPTokenizer"}, {"model_max_length", 77}, {"do_lower_case", true},
                          {"bos_token", "<|startoftext|>"}, {"eos_token", "<|endoftext|>"},
                          {"unk_token", "<|endoftext|>"}, {"pad_token", std::string(name) == "tokenizer" ? "<|endoftext|>" : "!"}}
               .dump(2);
  }
  p.tokenizer_dir = dir / "tokenizer";
  p.tokenizer_2_dir = dir / "tokenizer_2";
  df::sd3_transformer_config tc;
  tc.sample_size = 16;
  tc.patch_size = 2;
  tc.in_channels = tc.out_channels = 16;
  tc.num_layers = 4;
  tc.attention_head_dim = 64;
  tc.num_attention_heads = 2;
  tc.joint_attention_dim = 256;
  tc.caption_projection_dim = 128;
  tc.pooled_projection_dim = 192;
  tc.pos_embed_max_size = 16;
  tc.qk_rms_norm = true;
  p.transformer = df::sd3_transformer(tc);
  df::autoencoder_kl_config vc;
  vc.block_out_channels = {32, 32, 64, 64};
  vc.layers_per_block = 1;
  vc.latent_channels = 16;
  vc.norm_num_groups = 8;
  vc.sample_size = 128;
  p.vae = df::autoencoder_kl(vc);
  p.text_encoder = df::clip_text_encoder(clip_config(64));
  p.text_encoder_2 = df::clip_text_encoder(clip_config(128));
  p.scheduler.config = {.num_train_timesteps = 1000, .shift = 3.0};
  df::save_sd3(p, dir);
}

using model_t = unirl::models::flow_model<df::sd3_net>;

// The reward: the mean pixel of the VAE-decoded image (in [0, 1]); the decode is timed apart.
struct brightness {
  df::sd3_pipeline* pipe;
  double* decode_seconds;
  torch::Tensor operator()(const unirl::flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto t = clock_type::now();
    const auto img = pipe->vae->decode_latents(b.samples().to(torch::kFloat));
    *decode_seconds = since(t);
    return ((img.clamp(-1, 1) + 1) / 2).flatten(1).mean(1);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  std::map<std::string, std::string> a{{"cache", "1"}, {"checkpointing", "0"}, {"steps", "3"}, {"threads", "0"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    UNIRL_CHECK(k.rfind("--", 0) == 0, "bench_sd3_step: argument '", k, "': expected --name value");
    a[k.substr(2)] = argv[i + 1];
  }
  if (a.count("save")) {
    UNIRL_CHECK(a.count("tokenizer"), "bench_sd3_step --save: also give --tokenizer DIR (vocab.json, merges.txt)");
    save_pipeline(a["save"], a["tokenizer"]);
    std::cout << "wrote " << a["save"] << "\n";
    return 0;
  }
  UNIRL_CHECK(a.count("model"), "bench_sd3_step: give --model DIR (or --save DIR --tokenizer DIR)");
  if (std::stoi(a["threads"]) > 0) torch::set_num_threads(std::stoi(a["threads"]));
  const bool cache = a["cache"] == "1", checkpointing = a["checkpointing"] == "1";
  const auto steps = std::stoll(a["steps"]);

  torch::manual_seed(0);
  auto pipe = df::load_sd3(a["model"]);
  auto prompts = std::make_shared<df::sd3_prompts>(pipe, bench_prompts);
  prompts->set_caching(cache);
  model_t policy(df::sd3_net(pipe.transformer, prompts), pipe.latent_shape(128, 128), {.guidance = 4.5});
  unirl::lora::apply(*policy.net(), {.rank = 8, .alpha = 16.0, .targets = df::sd3_lora_targets()});
  double decode_seconds = 0;
  using trainer_t = unirl::trainer<model_t, unirl::algo::flow_grpo<>, brightness>;
  trainer_t::options o{};
  o.algorithm = {.beta = 0.04, .sampler = {.steps = 6, .noise_level = 0.7, .shift = 3.0}};
  o.optim = {.lr = 1e-4};
  o.clip = {.max_grad_norm = 1.0};
  if (checkpointing) o.memory.checkpointing = {"flow_blocks"};
  o.group_size = 4;
  o.progress = false;
  trainer_t t(std::move(policy), brightness{&pipe, &decode_seconds}, o);
  const auto conditions = torch::tensor({0, 1}, torch::kInt64);
  const std::vector<std::string> step_prompts{bench_prompts[0], bench_prompts[1], ""};

  std::map<std::string, std::vector<double>> figures;
  unirl::train::memory_tracker base(torch::kCPU);
  base.start();
  const double baseline = base.stop().current_mb;  // the loaded pipeline and trainer, before any step
  for (std::int64_t s = 0; s <= steps; ++s) {
    // Text encoding of the step's prompts and the empty one: what each encoder batch costs.
    unirl::train::memory_tracker mem(torch::kCPU);
    mem.start();
    const auto te = clock_type::now();
    (void)pipe.encode_prompts(step_prompts);
    const double text_seconds = since(te);
    const auto text_mem = mem.stop();
    const auto calls = prompts->encoder_calls();
    const auto c0 = std::clock();  // the process's CPU time: what the step cost, whatever else runs
    const auto st = t.step(conditions);
    const double step_cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    nlohmann::json j{{"step", s},
                     {"cache", cache},
                     {"checkpointing", checkpointing},
                     {"baseline_mb", baseline},
                     {"text_encoding_s", text_seconds},
                     {"sampling_s", st.time_sample},
                     {"vae_decode_s", decode_seconds},
                     {"reward_s", st.time_reward - decode_seconds},
                     {"update_s", st.time_advantage + st.time_update},
                     {"step_s", st.seconds},
                     {"step_cpu_s", step_cpu},
                     {"encoder_batches", prompts->encoder_calls() - calls},
                     {"text_encoding_peak_mb", text_mem.peak_mb},
                     {"sampling_peak_mb", st.extra.at("memory/sample_peak_mb")},
                     {"reward_peak_mb", st.extra.at("memory/reward_peak_mb")},
                     {"update_peak_mb", std::max(st.extra.at("memory/advantage_peak_mb"), st.extra.at("memory/update_peak_mb"))},
                     {"reward_mean", st.reward_mean},
                     {"loss", st.loss}};
    std::cout << j.dump() << "\n";
    if (s == 0) continue;  // warm-up
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it->is_number_float()) figures[it.key()].push_back(it->get<double>());
  }
  nlohmann::json m{{"median_of", steps}, {"cache", cache}, {"checkpointing", checkpointing},
                   {"torch_threads", torch::get_num_threads()}};
  for (const auto& [k, v] : figures) m[k] = median(v);
  std::cout << "median " << m.dump() << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_sd3_step: " << e.what() << "\n";
  return 1;
}

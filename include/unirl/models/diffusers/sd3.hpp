#pragma once
/// \file sd3.hpp
/// Stable Diffusion 3 / 3.5 in the diffusers layout: `load_sd3` reads a pipeline folder
/// (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`, `text_encoder_2/`,
/// `tokenizer/`, `tokenizer_2/`, `scheduler/`), `sd3_pipeline` encodes prompts and samples as
/// diffusers' StableDiffusion3Pipeline does, `sd3_net` makes the transformer a flow-track network
/// (`models::flow_model<sd3_net>`: every flow sampler and algorithm trains it), and `save_sd3` /
/// `save_transformer` / `save_lora` write the results back in diffusers' layout.
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// auto pipe = df::load_sd3("sd3-medium");                        // no T5: zero T5 tokens
/// auto latents = pipe.generate({"a red cube"}, noise, {.steps = 28, .guidance = 7.0});
/// auto images = pipe.vae->decode_latents(latents);               // (B, 3, H, W) in [-1, 1]
///
/// auto prompts = std::make_shared<df::sd3_prompts>(pipe, std::vector<std::string>{"a red cube"});
/// unirl::models::flow_model<df::sd3_net> model(df::sd3_net(pipe.transformer, prompts),
///                                               pipe.latent_shape(64, 64), {.guidance = 4.0});
/// unirl::lora::apply(*model.net(), {.rank = 8, .targets = df::sd3_lora_targets()});
/// // ... train with conditions = prompt indices (B,) int64 ...
/// df::save_lora(*model.net(), "out/lora");    // transformer.<module>.lora_A.weight / lora_B.weight
/// ```
///
/// T5: `text_encoder_3` is not supported. A pipeline folder whose model_index.json names one
/// is an error unless `load_options::allow_missing_t5` is set; SD3 then runs as diffusers runs it
/// without T5: the T5 tokens are zeros, `t5_tokens` of them (default 77, the CLIP tokenizer's
/// length, as diffusers' StableDiffusion3Pipeline up to 0.32; newer releases use
/// max_sequence_length = 256).
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/flow.hpp>
#include <unirl/core/error.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/diffusers/autoencoder_kl.hpp>
#include <unirl/models/diffusers/clip_text.hpp>
#include <unirl/models/diffusers/config.hpp>
#include <unirl/models/diffusers/sd3_transformer.hpp>
#include <unirl/models/lora.hpp>

namespace unirl::models::diffusers {

/// diffusers' FlowMatchEulerDiscreteScheduler with a static shift.
struct flow_match_euler_scheduler {
  flow_match_scheduler_config config;

  /// The (steps + 1,) float32 sigmas of `set_timesteps(steps)`: linspace from sigma_max = 1 to
  /// sigma_min (the shifted 1 / num_train_timesteps, in float32) over `steps`, shifted
  /// `s * x / (1 + (s - 1) x)` (float64, so sigma_min is shifted twice, as diffusers), then 0.
  torch::Tensor sigmas(std::int64_t steps) const {
    UNIRL_CHECK(steps >= 1, "diffusers::flow_match_euler_scheduler: steps = ", steps, ": expected >= 1");
    const auto n = static_cast<double>(config.num_train_timesteps);
    const double s = config.shift;
    const float first = static_cast<float>(1.0f / static_cast<float>(n));  // float32, as the table
    const float sigma_min = static_cast<float>(s) * first / (1.0f + (static_cast<float>(s) - 1.0f) * first);
    auto x = torch::linspace(1.0 * n, static_cast<double>(sigma_min) * n, steps, torch::kFloat64) / n;
    x = s * x / (1.0 + (s - 1.0) * x);
    return torch::cat({x.to(torch::kFloat), torch::zeros({1})});
  }
  /// The (steps,) float32 timesteps the transformer sees: sigmas * num_train_timesteps.
  torch::Tensor timesteps(std::int64_t steps) const {
    return sigmas(steps).slice(0, 0, steps) * static_cast<float>(config.num_train_timesteps);
  }
};

/// Options of `sd3_pipeline::generate`.
struct sd3_sample_options {
  std::int64_t steps = 28;
  double guidance = 7.0;   // classifier-free guidance scale; <= 1: conditional only (as diffusers)
};

/// Options of `load_sd3`.
struct sd3_load_options {
  bool allow_missing_t5 = false;  // a model_index.json naming text_encoder_3: run without it (zeros)
  std::int64_t t5_tokens = 77;    // length of the zero T5 sequence
  torch::ScalarType dtype = torch::kFloat;  // of every component's weights (the files' dtypes converted)
};

/// The components of an SD3 pipeline (see the file comment).
struct sd3_pipeline {
  model_index index;
  sd3_transformer transformer{nullptr};
  autoencoder_kl vae{nullptr};
  clip_text_encoder text_encoder{nullptr}, text_encoder_2{nullptr};
  clip_tokenizer tokenizer, tokenizer_2;
  flow_match_euler_scheduler scheduler;
  std::int64_t t5_tokens = 77;
  std::filesystem::path tokenizer_dir, tokenizer_2_dir;  // where the tokenizer files came from (save_sd3 copies them)

  /// The latent sample shape (C, H / f, W / f) of H x W images.
  std::vector<std::int64_t> latent_shape(std::int64_t height, std::int64_t width) const {
    const auto f = vae->downsample_factor();
    UNIRL_CHECK(height % f == 0 && width % f == 0, "diffusers::sd3_pipeline: ", height, " x ", width,
                " images: expected multiples of the VAE's factor ", f);
    return {transformer->config().in_channels, height / f, width / f};
  }

  /// StableDiffusion3Pipeline.encode_prompt without T5: text tokens (B, 77 + t5_tokens,
  /// joint_attention_dim) = [CLIP-L | CLIP-G penultimate states, zero-padded to the width ; zeros],
  /// pooled (B, proj_L + proj_G). No gradients (the encoders are frozen).
  std::pair<torch::Tensor, torch::Tensor> encode_prompts(const std::vector<std::string>& prompts) const {
    torch::NoGradGuard ng;
    UNIRL_CHECK(!prompts.empty(), "diffusers::sd3_pipeline::encode_prompts: no prompts");
    const auto [h1, p1] = text_encoder.ptr()->encode(tokenizer.encode_batch(prompts));
    const auto [h2, p2] = text_encoder_2.ptr()->encode(tokenizer_2.encode_batch(prompts));
    UNIRL_CHECK(h1.size(1) == h2.size(1), "diffusers::sd3_pipeline: the tokenizers pad to ", h1.size(1), " and ",
                h2.size(1), " tokens: expected the same length");
    const auto J = transformer->config().joint_attention_dim;
    auto clip = torch::cat({h1, h2}, -1);
    UNIRL_CHECK(clip.size(2) <= J, "diffusers::sd3_pipeline: the CLIP widths add to ", clip.size(2),
                ": expected at most joint_attention_dim = ", J);
    clip = torch::constant_pad_nd(clip, {0, J - clip.size(2)}, 0.0);
    const auto t5 = torch::zeros({clip.size(0), t5_tokens, J}, clip.options());
    return {torch::cat({clip, t5}, 1), torch::cat({p1, p2}, -1)};
  }

  /// diffusers' sampling loop: Euler steps over `scheduler.sigmas(steps)` from `noise`
  /// (B, C, h, w) (the initial latents), guidance against the empty prompt. Returns the latents.
  torch::Tensor generate(const std::vector<std::string>& prompts, const torch::Tensor& noise,
                         const sd3_sample_options& o = {}) const {
    torch::NoGradGuard ng;
    UNIRL_CHECK(noise.dim() == 4 && noise.size(0) == static_cast<std::int64_t>(prompts.size()),
                "diffusers::sd3_pipeline::generate: noise of sizes ", noise.sizes(), " for ", prompts.size(),
                " prompts: expected (", prompts.size(), ", C, h, w)");
    const bool cfg = o.guidance > 1.0;
    auto [ctx, pooled] = encode_prompts(prompts);
    if (cfg) {
      const auto [nc, np] = encode_prompts(std::vector<std::string>(prompts.size(), ""));
      ctx = torch::cat({nc, ctx});
      pooled = torch::cat({np, pooled});
    }
    const auto sig = scheduler.sigmas(o.steps);
    const auto ts = scheduler.timesteps(o.steps);
    auto x = noise.to(torch::kFloat);
    // The transformer runs in its weights' dtype; the Euler steps accumulate in float32.
    const auto dt = transformer.ptr()->proj_out->weight.scalar_type();
    for (std::int64_t i = 0; i < o.steps; ++i) {
      const auto in = (cfg ? torch::cat({x, x}) : x).to(dt);
      auto v = transformer.ptr()->forward(in, ts[i].expand({in.size(0)}), ctx.to(dt), pooled.to(dt)).to(torch::kFloat);
      if (cfg) {
        const auto parts = v.chunk(2);
        v = parts[0] + o.guidance * (parts[1] - parts[0]);
      }
      x = x + (sig[i + 1] - sig[i]) * v;
    }
    return x;
  }
};

namespace detail {

// The weights of a component folder: diffusion_pytorch_model.safetensors (or its index), or the
// transformers names model.safetensors (or its index) for the text encoders.
inline std::filesystem::path weights_path(const std::filesystem::path& dir, const char* stem) {
  std::error_code ec;
  const auto single = dir / (std::string(stem) + ".safetensors");
  if (std::filesystem::is_regular_file(single, ec)) return single;
  const auto index = dir / (std::string(stem) + ".safetensors.index.json");
  UNIRL_CHECK(std::filesystem::is_regular_file(index, ec), "diffusers: ", dir.string(), " holds neither ",
              single.filename().string(), " nor ", index.filename().string());
  return index;
}

inline named_tensors targets_of(const torch::nn::Module& m) {
  named_tensors t;
  for (const auto& p : m.named_parameters()) t.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers()) t.emplace_back(b.key(), b.value());
  return t;
}

inline void load_weights(torch::nn::Module& m, const std::filesystem::path& dir, const char* stem) {
  const io::safetensors_checkpoint ckpt(weights_path(dir, stem));
  // transformers' older CLIP checkpoints carry the position_ids buffer; it is arange(L).
  io::load_into(targets_of(m), ckpt, {.ignore_unexpected = {"text_model.embeddings.position_ids"}});
}

inline void expect_component(const model_index& idx, const std::string& name, const char* cls,
                             const std::filesystem::path& file) {
  const auto c = idx.component(name);
  UNIRL_CHECK(c && c->second == cls, "diffusers ", file.string(), ": component '", name, "' is ",
              c ? "[\"" + c->first + "\", \"" + c->second + "\"]" : std::string("absent"), ": expected class ", cls);
}

}  // namespace detail

/// What an SD3 pipeline folder declares, read without its tensors: model_index.json and every
/// component's config, each checked as `load_sd3` checks it, and each weights file (or shard
/// index) present. A program checks a folder with it before it spends time on anything.
struct sd3_layout {
  model_index index;
  sd3_transformer_config transformer;
  autoencoder_kl_config vae;
  clip_text_config text_encoder, text_encoder_2;
  flow_match_scheduler_config scheduler;

  /// The VAE's spatial factor (2^(stages - 1)).
  std::int64_t vae_factor() const { return std::int64_t{1} << (vae.block_out_channels.size() - 1); }
};

/// Reads and checks the layout of the SD3 pipeline folder `dir` (see `sd3_layout`); throws a
/// `unirl::error` naming the file and the key or component at fault.
inline sd3_layout inspect_sd3(const std::filesystem::path& dir, const sd3_load_options& o = {}) {
  const auto index_file = dir / "model_index.json";
  std::error_code ec;
  UNIRL_CHECK(std::filesystem::is_regular_file(index_file, ec), "diffusers: ", dir.string(),
              " is not a diffusers pipeline folder: it has no model_index.json");
  sd3_layout p;
  p.index = model_index::load(index_file);
  UNIRL_CHECK(p.index.class_name == "StableDiffusion3Pipeline", "diffusers ", index_file.string(),
              ": _class_name = \"", p.index.class_name, "\": expected StableDiffusion3Pipeline");
  detail::expect_component(p.index, "transformer", "SD3Transformer2DModel", index_file);
  detail::expect_component(p.index, "vae", "AutoencoderKL", index_file);
  detail::expect_component(p.index, "text_encoder", "CLIPTextModelWithProjection", index_file);
  detail::expect_component(p.index, "text_encoder_2", "CLIPTextModelWithProjection", index_file);
  detail::expect_component(p.index, "scheduler", "FlowMatchEulerDiscreteScheduler", index_file);
  for (const char* tok : {"tokenizer", "tokenizer_2"}) {
    const auto c = p.index.component(tok);
    UNIRL_CHECK(c && (c->second == "CLIPTokenizer" || c->second == "CLIPTokenizerFast"), "diffusers ",
                index_file.string(), ": component '", tok, "': expected class CLIPTokenizer");
  }
  UNIRL_CHECK(!p.index.component("text_encoder_3") || o.allow_missing_t5, "diffusers ", index_file.string(),
              ": component 'text_encoder_3' (T5) is not supported: set allow_missing_t5 to run with zero T5 tokens");
  for (const auto& [name, c] : p.index.components) {
    static const std::set<std::string> known{"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                                             "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler",
                                             "image_encoder", "feature_extractor"};
    UNIRL_CHECK(known.count(name) != 0, "diffusers ", index_file.string(), ": key '", name,
                "': unknown component of StableDiffusion3Pipeline");
    if (name == "image_encoder" || name == "feature_extractor")
      UNIRL_CHECK(!c, "diffusers ", index_file.string(), ": component '", name, "' (IP-Adapter) is not supported");
  }
  UNIRL_CHECK(o.t5_tokens >= 0, "diffusers::load_sd3: t5_tokens = ", o.t5_tokens, ": expected >= 0");
  UNIRL_CHECK(o.dtype == torch::kFloat || o.dtype == torch::kBFloat16 || o.dtype == torch::kHalf,
              "diffusers::load_sd3: dtype = ", o.dtype, ": expected float32, bfloat16 or float16");
  p.transformer = sd3_transformer_config::load(dir / "transformer");
  p.vae = autoencoder_kl_config::load(dir / "vae");
  p.text_encoder = clip_text_config::load(dir / "text_encoder");
  p.text_encoder_2 = clip_text_config::load(dir / "text_encoder_2");
  p.scheduler = flow_match_scheduler_config::load(dir / "scheduler");
  (void)detail::weights_path(dir / "transformer", "diffusion_pytorch_model");
  (void)detail::weights_path(dir / "vae", "diffusion_pytorch_model");
  (void)detail::weights_path(dir / "text_encoder", "model");
  (void)detail::weights_path(dir / "text_encoder_2", "model");
  for (const char* tok : {"tokenizer", "tokenizer_2"})
    for (const char* f : {"vocab.json", "merges.txt"})
      UNIRL_CHECK(std::filesystem::is_regular_file(dir / tok / f, ec), "diffusers: ", (dir / tok).string(),
                  " has no ", f);
  return p;
}

/// Reads an SD3 pipeline folder (see the file comment); every config key checked (`inspect_sd3`),
/// every tensor of every component loaded in `o.dtype` (float32 unless asked; a bf16 file
/// loads into float32 weights, a float32 one into bf16 weights with `.dtype = torch::kBFloat16`).
inline sd3_pipeline load_sd3(const std::filesystem::path& dir, const sd3_load_options& o = {}) {
  const auto layout = inspect_sd3(dir, o);
  sd3_pipeline p;
  p.index = layout.index;
  p.t5_tokens = o.t5_tokens;
  p.transformer = sd3_transformer(layout.transformer);
  p.transformer->to(o.dtype);
  detail::load_weights(*p.transformer, dir / "transformer", "diffusion_pytorch_model");
  p.vae = autoencoder_kl(layout.vae);
  p.vae->to(o.dtype);
  detail::load_weights(*p.vae, dir / "vae", "diffusion_pytorch_model");
  p.text_encoder = clip_text_encoder(layout.text_encoder);
  p.text_encoder->to(o.dtype);
  detail::load_weights(*p.text_encoder, dir / "text_encoder", "model");
  p.text_encoder_2 = clip_text_encoder(layout.text_encoder_2);
  p.text_encoder_2->to(o.dtype);
  detail::load_weights(*p.text_encoder_2, dir / "text_encoder_2", "model");
  p.tokenizer_dir = dir / "tokenizer";
  p.tokenizer_2_dir = dir / "tokenizer_2";
  p.tokenizer = clip_tokenizer::from_dir(p.tokenizer_dir);
  p.tokenizer_2 = clip_tokenizer::from_dir(p.tokenizer_2_dir);
  p.scheduler.config = layout.scheduler;
  for (auto* m : std::vector<torch::nn::Module*>{p.text_encoder.ptr().get(), p.text_encoder_2.ptr().get(), p.vae.ptr().get()})
    for (auto& t : m->parameters()) t.set_requires_grad(false);
  return p;
}

/// Options of `save_sd3` / `save_transformer`.
struct sd3_save_options {
  /// Largest weights file: a component above it is written as shards
  /// `<stem>-0000i-of-0000n.safetensors` and `<stem>.safetensors.index.json`, as diffusers'
  /// and transformers' `save_pretrained(max_shard_size=...)` write them (stem
  /// diffusion_pytorch_model, or model for the text encoders). Default: diffusers' 10GB.
  std::uint64_t max_shard_bytes = 10'000'000'000;
};

/// Writes `transformer` to `dir` as diffusers' layout: config.json and
/// diffusion_pytorch_model.safetensors, or its shards and index above `o.max_shard_bytes` (LoRA
/// adapters merged into their weights, W + (alpha/r) B A).
inline void save_transformer(const sd3_transformer& transformer, const std::filesystem::path& dir,
                             const sd3_save_options& o = {}) {
  std::filesystem::create_directories(dir);
  auto tensors = lora::merged_parameters(*transformer);
  for (const auto& b : transformer->named_buffers()) tensors.emplace_back(b.key(), b.value().detach());
  io::save_safetensors_sharded(dir, tensors, o.max_shard_bytes, {}, "diffusion_pytorch_model");
  std::ofstream(dir / "config.json") << transformer->config().to_json().dump(2) << "\n";
}

/// Writes the whole pipeline to `dir` (model_index.json, every component, the tokenizer files),
/// each component's weights in one file or, above `o.max_shard_bytes`, in shards with an index.
inline void save_sd3(const sd3_pipeline& p, const std::filesystem::path& dir, const sd3_save_options& o = {}) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  model_index idx;
  idx.class_name = "StableDiffusion3Pipeline";
  idx.components = {{"transformer", std::make_pair("diffusers", "SD3Transformer2DModel")},
                    {"vae", std::make_pair("diffusers", "AutoencoderKL")},
                    {"text_encoder", std::make_pair("transformers", "CLIPTextModelWithProjection")},
                    {"text_encoder_2", std::make_pair("transformers", "CLIPTextModelWithProjection")},
                    {"text_encoder_3", std::nullopt},
                    {"tokenizer", std::make_pair("transformers", "CLIPTokenizer")},
                    {"tokenizer_2", std::make_pair("transformers", "CLIPTokenizer")},
                    {"tokenizer_3", std::nullopt},
                    {"scheduler", std::make_pair("diffusers", "FlowMatchEulerDiscreteScheduler")}};
  std::ofstream(dir / "model_index.json") << idx.to_json().dump(2) << "\n";
  save_transformer(p.transformer, dir / "transformer", o);
  fs::create_directories(dir / "vae");
  io::save_safetensors_sharded(dir / "vae", detail::targets_of(*p.vae), o.max_shard_bytes, {}, "diffusion_pytorch_model");
  std::ofstream(dir / "vae" / "config.json") << p.vae->config().to_json().dump(2) << "\n";
  const std::pair<const clip_text_encoder*, const char*> encoders[] = {{&p.text_encoder, "text_encoder"},
                                                                        {&p.text_encoder_2, "text_encoder_2"}};
  for (const auto& [enc, name] : encoders) {
    fs::create_directories(dir / name);
    io::save_safetensors_sharded(dir / name, detail::targets_of(**enc), o.max_shard_bytes, {}, "model");
    auto cfg = (*enc)->config().to_json();
    const auto dt = (*enc)->parameters().front().scalar_type();
    cfg["torch_dtype"] = dt == torch::kBFloat16 ? "bfloat16" : dt == torch::kHalf ? "float16" : "float32";
    std::ofstream(dir / name / "config.json") << cfg.dump(2) << "\n";
  }
  const std::pair<const fs::path*, const char*> toks[] = {{&p.tokenizer_dir, "tokenizer"}, {&p.tokenizer_2_dir, "tokenizer_2"}};
  for (const auto& [src, name] : toks) {
    fs::create_directories(dir / name);
    for (const char* f : {"vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"}) {
      std::error_code ec;
      if (fs::is_regular_file(*src / f, ec) && fs::absolute(*src / f) != fs::absolute(dir / name / f))
        fs::copy_file(*src / f, dir / name / f, fs::copy_options::overwrite_existing);
    }
  }
  fs::create_directories(dir / "scheduler");
  std::ofstream(dir / "scheduler" / "scheduler_config.json") << p.scheduler.config.to_json().dump(2) << "\n";
}

/// The linear layers diffusers' SD3 LoRA recipes adapt: attention (image and text streams) and
/// both MLPs of every block.
inline std::vector<std::string> sd3_lora_targets() {
  return {"attn.to_q",      "attn.to_k",       "attn.to_v",        "attn.to_out.0", "attn.add_q_proj",
          "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
          "ff_context.net.0.proj", "ff_context.net.2"};
}

/// The prompts a flow-track run conditions on, and their text embeddings, each computed once
/// (the encoders are frozen) and kept until `clear`. A condition is a prompt's index; -1 is the
/// empty prompt, the unconditional branch of guidance.
///
/// The prompts are encoded in fixed groups of `group` by position (the empty prompt first, then
/// prompt 0, 1, ...: group g holds positions [g * group, (g + 1) * group)), a whole group the
/// first time any of it is needed. A prompt's embedding is then the same bits whichever prompts
/// were asked for before it: a BLAS may round a row differently in a batch of another size (a
/// resumed run, a sampler process and the learner each see other request orders).
class sd3_prompts {
 public:
  sd3_prompts(const sd3_pipeline& p, std::vector<std::string> prompts, std::int64_t group = 8)
      : pipe_(p), prompts_(std::move(prompts)), group_(group) {
    UNIRL_CHECK(!prompts_.empty(), "diffusers::sd3_prompts: no prompts");
    UNIRL_CHECK(group_ >= 1, "diffusers::sd3_prompts: group ", group_, ": expected >= 1 prompts per encoder batch");
  }

  /// Text tokens and pooled text of conditions `cond` ((B,) int64 indices, -1 = empty prompt),
  /// on `device`; each group holding a prompt not yet encoded is encoded, one batch per group.
  std::pair<torch::Tensor, torch::Tensor> embeddings(const torch::Tensor& cond, const torch::Device& device) {
    UNIRL_CHECK(cond.dim() == 1 && !cond.is_floating_point(), "diffusers::sd3_prompts: conditions of sizes ",
                cond.sizes(), " ", cond.dtype(), ": expected (B,) prompt indices");
    if (!caching_) cache_.clear();
    const auto idx = cond.to(torch::kCPU, torch::kInt64).contiguous();
    const auto* v = idx.data_ptr<std::int64_t>();
    const auto n = static_cast<std::int64_t>(prompts_.size());
    std::vector<std::int64_t> groups;  // in the order first needed
    for (std::int64_t i = 0; i < idx.numel(); ++i) {
      UNIRL_CHECK(v[i] >= -1 && v[i] < n, "diffusers::sd3_prompts: condition ", v[i],
                  ": expected a prompt index in [0, ", n, ") or -1 (the empty prompt)");
      const auto g = (v[i] + 1) / group_;
      if (!cache_.count(v[i]) && std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    }
    for (const auto g : groups) {
      const auto first = g * group_ - 1, last = std::min(first + group_, n);  // indices [first, last)
      std::vector<std::string> texts;
      for (auto k = first; k < last; ++k) texts.push_back(k < 0 ? std::string() : prompts_[static_cast<std::size_t>(k)]);
      const auto [ctx, pooled] = pipe_.encode_prompts(texts);
      ++encoder_calls_;
      encoded_prompts_ += last - first;
      for (auto k = first; k < last; ++k) cache_[k] = {ctx[k - first], pooled[k - first]};
    }
    std::vector<torch::Tensor> c, p;
    for (std::int64_t i = 0; i < idx.numel(); ++i) {
      const auto& e = cache_.at(v[i]);
      c.push_back(e.first);
      p.push_back(e.second);
    }
    return {torch::stack(c).to(device), torch::stack(p).to(device)};
  }

  const std::vector<std::string>& prompts() const { return prompts_; }
  /// Prompts per encoder batch (the empty prompt counts as one).
  std::int64_t group() const { return group_; }
  /// Batches sent through the text encoders, and prompts encoded (the empty one included), since
  /// construction.
  std::int64_t encoder_calls() const { return encoder_calls_; }
  std::int64_t encoded_prompts() const { return encoded_prompts_; }
  void clear() { cache_.clear(); }
  /// With `on = false` every `embeddings` call encodes its prompts afresh (each transformer call
  /// of sampling and of the update): the cost the cache saves, for measurements.
  void set_caching(bool on) {
    caching_ = on;
    if (!on) cache_.clear();
  }
  bool caching() const { return caching_; }

 private:
  const sd3_pipeline& pipe_;
  std::vector<std::string> prompts_;
  std::map<std::int64_t, std::pair<torch::Tensor, torch::Tensor>> cache_;
  std::int64_t group_;
  std::int64_t encoder_calls_ = 0, encoded_prompts_ = 0;
  bool caching_ = true;
};

/// The transformer as a flow-track network (`ConditionalNet`): `forward(x, t, cond)` with t the
/// flow time in [0, 1] (diffusers' sigma; the transformer sees t * num_train_timesteps) and
/// `cond` prompt indices into `sd3_prompts`; `null_condition` is the empty prompt (-1). Its only
/// submodule is `transformer`, so LoRA names are diffusers' `transformer.<module>`.
class sd3_net_impl : public torch::nn::Cloneable<sd3_net_impl>, public lora::adaptable {
 public:
  /// Wraps `transformer` itself (not a copy): training it trains the pipeline's transformer.
  sd3_net_impl(sd3_transformer transformer, std::shared_ptr<sd3_prompts> prompts, double num_train_timesteps = 1000.0)
      : config_(transformer->config()), prompts_(std::move(prompts)), scale_(num_train_timesteps) {
    UNIRL_CHECK(prompts_ != nullptr, "diffusers::sd3_net: no prompts");
    this->transformer = register_module("transformer", std::move(transformer));
  }
  // A clone's fresh transformer (its weights are then copied from the original's).
  void reset() override { transformer = register_module("transformer", sd3_transformer(config_)); }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    const auto [ctx, pooled] = prompts_->embeddings(cond, x.device());
    return transformer->forward(x, t.to(torch::kFloat) * scale_, ctx.to(x.scalar_type()), pooled.to(x.scalar_type()));
  }
  torch::Tensor null_condition(const torch::Tensor& cond) const { return torch::full_like(cond, -1); }

  /// Activation checkpointing of the transformer's blocks (`checkpoint_kind::flow_blocks`).
  void set_checkpointing(const std::vector<std::string>& kinds) { transformer->set_checkpointing(kinds); }
  std::vector<std::string> checkpointing_kinds() const { return transformer->checkpointing_kinds(); }

  sd3_prompts& prompts() { return *prompts_; }
  sd3_transformer transformer{nullptr};

 private:
  sd3_transformer_config config_;
  std::shared_ptr<sd3_prompts> prompts_;
  double scale_;
};
TORCH_MODULE_IMPL(sd3_net, sd3_net_impl);

static_assert(ConditionalNet<sd3_net>);

/// Writes the LoRA adapters of `net` (an `sd3_net`, or anything whose modules are named
/// `transformer.<module>`) as diffusers' `pytorch_lora_weights.safetensors`: tensors
/// `transformer.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), with B scaled
/// by alpha / r so the file's scaling is 1, and PEFT's `adapter_config.json` (r, lora_alpha = r,
/// target_modules). Throws when `net` has no adapters.
inline void save_lora(const torch::nn::Module& net, const std::filesystem::path& dir) {
  const auto mods = lora::adapted_modules(net);
  UNIRL_CHECK(!mods.empty(), "diffusers::save_lora: the network has no LoRA adapters");
  named_tensors out;
  std::set<std::string> targets;
  std::int64_t rank = 0;
  for (const auto& [name, m] : mods) {
    const auto [a, b] = lora::detail::factors_of(*m);
    UNIRL_CHECK(a && b, "diffusers::save_lora: module ", name, " has no lora_A / lora_B");
    UNIRL_CHECK(name.rfind("transformer.", 0) == 0, "diffusers::save_lora: adapted module ", name,
                ": expected a name starting with transformer.");
    UNIRL_CHECK(rank == 0 || rank == a->rank(), "diffusers::save_lora: ranks ", rank, " and ", a->rank(),
                ": expected one rank for every adapter");
    rank = a->rank();
    out.emplace_back(name + ".lora_A.weight", a->weight.detach().to(torch::kFloat));
    out.emplace_back(name + ".lora_B.weight", (b->weight.detach() * a->scaling()).to(torch::kFloat));
    targets.insert(name.substr(std::string("transformer.").size()));
  }
  std::filesystem::create_directories(dir);
  io::save_safetensors(dir / "pytorch_lora_weights.safetensors", out);
  nlohmann::json cfg{{"peft_type", "LORA"},
                     {"r", rank},
                     {"lora_alpha", rank},
                     {"lora_dropout", 0.0},
                     {"bias", "none"},
                     {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
                     {"init_lora_weights", true}};
  std::ofstream(dir / "adapter_config.json") << cfg.dump(2) << "\n";
}

/// Attaches the adapters of a `save_lora` file to `net` (alpha = r: the file's scaling is 1)
/// and copies their weights; the base weights are frozen as `lora::apply` does.
inline void load_lora(torch::nn::Module& net, const std::filesystem::path& dir) {
  const io::safetensors_checkpoint ckpt(dir / "pytorch_lora_weights.safetensors");
  std::vector<std::string> modules;
  std::int64_t rank = 0;
  for (const auto& n : ckpt.names()) {
    const auto at = n.find(".lora_A.weight");
    if (at == std::string::npos) continue;
    modules.push_back(n.substr(0, at));
    rank = ckpt.info(n).shape.at(0);
  }
  UNIRL_CHECK(!modules.empty(), "diffusers::load_lora: ", ckpt.source().string(), " has no lora_A tensors");
  lora::apply(net, {.rank = rank, .alpha = static_cast<double>(rank), .targets = modules});
  named_tensors targets;
  for (const auto& p : net.named_parameters())
    if (p.key().find(".lora_A.") != std::string::npos || p.key().find(".lora_B.") != std::string::npos)
      targets.emplace_back(p.key(), p.value());
  io::load_into(targets, ckpt);
}

}  // namespace unirl::models::diffusers

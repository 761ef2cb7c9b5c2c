#pragma once
/// \file pretrained.hpp
/// Loading and saving Hugging Face model directories (config.json + safetensors) as
/// `hf::causal_lm`: `from_pretrained` reads what Hugging Face's `save_pretrained` writes (one
/// model.safetensors or shards with model.safetensors.index.json), and `save_pretrained` writes
/// a directory Hugging Face (or any safetensors reader) loads back, with the original tensor names.
///
/// ```cpp
/// namespace hf = unirl::models::hf;
/// auto lm = hf::from_pretrained("Qwen2.5-0.5B", {.dtype = hf::weight_dtype::float32, .device = "cpu"});
/// // ... train ...
/// hf::save_pretrained(lm, "out/step-100", {.copy_tokenizer_from = "Qwen2.5-0.5B"});
/// ```
/// Tied embeddings: the checkpoint may hold `lm_head.weight` or not (Hugging Face omits it);
/// either loads, and saving omits it as Hugging Face does. GPT-2 files with the base model's
/// names (`wte.weight`, `h.0.attn.c_attn.weight`, as the original hub files) and Llama-family
/// files without the `model.` prefix load too, as do the non-persistent buffers older files
/// carry (`attn.bias`, `attn.masked_bias`, `rotary_emb.inv_freq`), which are skipped.
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/hf/config.hpp>
#include <unirl/models/lora.hpp>

namespace unirl::models::hf {

/// Dtype of the weights: as config.json's torch_dtype says, or a given one.
enum class weight_dtype { as_config, float32, bfloat16, float16 };

}  // namespace unirl::models::hf

template <>
inline constexpr std::array unirl::enum_names<unirl::models::hf::weight_dtype>{
    std::string_view{"as_config"}, std::string_view{"float32"}, std::string_view{"bfloat16"},
    std::string_view{"float16"}};

namespace unirl::models::hf {

/// How `from_pretrained` places the weights.
struct from_pretrained_options {
  weight_dtype dtype = weight_dtype::float32;  // float32 for training; as_config keeps the stored dtype
  std::string device = "cpu";                  // "cpu", "cuda", "cuda:1", ...
};

/// How `save_pretrained` writes a directory.
struct save_pretrained_options {
  weight_dtype dtype = weight_dtype::as_config;  // as_config: the model's config torch_dtype
  std::string copy_tokenizer_from;               // a directory whose tokenizer files are copied ("" = none)
  std::uint64_t max_shard_bytes = 5'000'000'000;  // larger: model-0000i-of-0000n.safetensors + index (as Hugging Face's 5GB)
};

}  // namespace unirl::models::hf

BOOST_HANA_ADAPT_STRUCT(unirl::models::hf::from_pretrained_options, dtype, device);
BOOST_HANA_ADAPT_STRUCT(unirl::models::hf::save_pretrained_options, dtype, copy_tokenizer_from, max_shard_bytes);

namespace unirl::models::hf {

/// Files `save_pretrained` copies from `copy_tokenizer_from` when present.
inline constexpr std::array<std::string_view, 11> tokenizer_files{
    "tokenizer.json",   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json",       "merges.txt",            "tokenizer.model",         "vocab.txt",
    "chat_template.jinja", "chat_template.json",  "generation_config.json"};

namespace detail {

inline torch::ScalarType torch_dtype_of(const std::string& name, const std::string& where) {
  if (name == "float32") return torch::kFloat;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kHalf;
  throw error("unirl: " + where + ": torch_dtype \"" + name + "\": expected float32, bfloat16 or float16");
}

inline std::string torch_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    default: throw error(std::string("unirl: hf: weights of dtype ") + c10::toString(t) +
                         " cannot be saved as a Hugging Face torch_dtype (float32, bfloat16 or float16)");
  }
}

inline torch::ScalarType resolve_dtype(weight_dtype d, const decoder_config& c, const std::string& where) {
  switch (d) {
    case weight_dtype::float32: return torch::kFloat;
    case weight_dtype::bfloat16: return torch::kBFloat16;
    case weight_dtype::float16: return torch::kHalf;
    case weight_dtype::as_config: break;
  }
  return torch_dtype_of(c.torch_dtype, where);
}

// Tensors older or base-model checkpoints carry that are not parameters: skipped on load.
inline bool ignorable_tensor(const decoder_config& c, const std::string& name) {
  if (c.tie_word_embeddings && name == "lm_head.weight") return true;
  if (c.is_gpt2()) return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
  return name.ends_with(".rotary_emb.inv_freq");
}

}  // namespace detail

/// Loads a Hugging Face model directory (config.json + model.safetensors, or shards with
/// model.safetensors.index.json) as a `causal_lm`. Errors name the file and the key or tensor:
/// an unsupported config, a tensor missing from the checkpoint or of the wrong shape.
inline causal_lm from_pretrained(const std::filesystem::path& dir, const from_pretrained_options& o = {}) {
  namespace fs = std::filesystem;
  UNIRL_CHECK(fs::is_directory(dir), "hf::from_pretrained: ", dir.string(),
              " is not a directory (expected a Hugging Face model directory: config.json + *.safetensors)");
  const auto config = decoder_config::load(dir / "config.json");
  const auto dtype = detail::resolve_dtype(o.dtype, config, (dir / "config.json").string());
  torch::Device device(torch::kCPU);
  try {
    device = torch::Device(o.device);
  } catch (const c10::Error&) {
    throw error("unirl: hf::from_pretrained: device = \"" + o.device + "\": expected cpu, cuda or cuda:N");
  }
  causal_lm lm(config);
  lm.net()->to(dtype);
  lm.to(device);

  const io::safetensors_checkpoint ckpt(dir);
  // Checkpoint name of each parameter: its own, or without the base model's prefix.
  const std::string base = config.is_gpt2() ? "transformer." : "model.";
  std::vector<std::pair<std::string, torch::Tensor>> targets;
  for (auto& [name, t] : lm.named_parameters()) {
    std::string key = name;
    if (!ckpt.contains(key) && key.starts_with(base) && ckpt.contains(key.substr(base.size())))
      key = key.substr(base.size());
    targets.emplace_back(std::move(key), t);
  }
  io::load_options lo;
  for (const auto& n : ckpt.names())
    if (detail::ignorable_tensor(config, n)) lo.ignore_unexpected.push_back(n);
  io::load_into(targets, ckpt, lo);
  return lm;
}

/// Writes `model` as a Hugging Face model directory: config.json (torch_dtype set to the saved
/// dtype) and model.safetensors (or shards above `max_shard_bytes`, with
/// model.safetensors.index.json), tensors under their Hugging Face names, tied `lm_head.weight`
/// omitted; then the tokenizer files of `copy_tokenizer_from`. A model with LoRA adapters is
/// written with each adapter merged into its weight (`lora::merged_parameters`; the adapter alone:
/// `lora::save_adapter`). Weight files of an earlier save in
/// `dir` (model.safetensors, model-*-of-*.safetensors, the index) are replaced.
inline void save_pretrained(const causal_lm& model, const std::filesystem::path& dir,
                            const save_pretrained_options& o = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  UNIRL_CHECK(fs::is_directory(dir), "hf::save_pretrained: cannot create the directory ", dir.string(),
              ec ? ": " + ec.message() : std::string());
  auto config = model.config();
  const auto dtype = detail::resolve_dtype(o.dtype, config, "hf::save_pretrained");
  config.torch_dtype = detail::torch_dtype_name(dtype);

  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  {
    torch::NoGradGuard ng;
    // A model with LoRA adapters is written merged (W + (alpha / r) B A), under the base names.
    const auto params =
        lora::has_adapters(*model.net()) ? lora::merged_parameters(*model.net()) : model.named_parameters();
    for (const auto& [name, t] : params) tensors.emplace_back(name, t.detach().to(torch::kCPU, dtype).contiguous());
  }
  // One model.safetensors when it fits, else shards + index; stale files of the other layout go.
  io::save_safetensors_sharded(dir, tensors, o.max_shard_bytes, {{"format", "pt"}});

  {
    std::ofstream out(dir / "config.json");
    out << config.to_json().dump(2) << "\n";
    UNIRL_CHECK(out.good(), "hf::save_pretrained: cannot write ", (dir / "config.json").string());
  }
  if (!o.copy_tokenizer_from.empty()) {
    const fs::path src(o.copy_tokenizer_from);
    UNIRL_CHECK(fs::is_directory(src), "hf::save_pretrained: copy_tokenizer_from = ", src.string(),
                ": not a directory");
    if (fs::equivalent(src, dir)) return;
    for (const auto name : tokenizer_files) {
      const auto from = src / std::string(name);
      if (!fs::is_regular_file(from)) continue;
      fs::copy_file(from, dir / std::string(name), fs::copy_options::overwrite_existing, ec);
      UNIRL_CHECK(!ec, "hf::save_pretrained: cannot copy ", from.string(), " to ", dir.string(), ": ", ec.message());
    }
  }
}

}  // namespace unirl::models::hf

#pragma once
/// \file llava.hpp
/// Loading and saving Hugging Face LLaVA directories (LlavaForConditionalGeneration: config.json
/// + model.safetensors or shards with model.safetensors.index.json) as their three parts: the
/// vision tower (`clip_vision`), the connector (`llava_projector`) and the language model
/// (`hf::causal_lm`), with Hugging Face's tensor names.
///
/// ```cpp
/// namespace vision = unirl::models::vision;
/// auto m = vision::load_llava("llava-1.5-7b-hf", {.dtype = unirl::models::hf::weight_dtype::bfloat16});
/// auto f = m.vision_tower->features(pixels, m.config.vision_feature_layer,
///                                   m.config.vision_feature_select_strategy);
/// auto image_embeds = m.projector(f);                        // (B, n, text hidden)
/// vision::save_llava(m, "out/step-100");                     // the layout it was read in
/// ```
/// Two layouts are read (and written back as read, or as `save_llava_options::layout` says):
/// - `legacy` (transformers < 4.52): `vision_tower.vision_model.*`, `multi_modal_projector.*`,
///   `language_model.model.*`, `language_model.lm_head.weight`;
/// - `current` (later transformers): `model.vision_tower.vision_model.*`,
///   `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`.
/// Skipped on load: `lm_head` when the text model ties it, buffers older files carry
/// (`*.position_ids`, `*.rotary_emb.inv_freq`), and SigLIP's pooling head (`vision_model.head.*`,
/// which LLaVA never runs). Every other problem — a tensor missing, unexpected, of another shape
/// or of a non-floating dtype — is one error listing each, naming the tensor and the file.
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/models/vision/clip.hpp>
#include <unirl/models/vision/config.hpp>
#include <unirl/models/vision/projector.hpp>

namespace unirl::models::vision {

/// Tensor naming of a LLaVA checkpoint (see the file comment).
enum class llava_layout { as_loaded, legacy, current };

}  // namespace unirl::models::vision

template <>
inline constexpr std::array unirl::enum_names<unirl::models::vision::llava_layout>{
    std::string_view{"as_loaded"}, std::string_view{"legacy"}, std::string_view{"current"}};

namespace unirl::models::vision {

/// How `save_llava` writes a directory.
struct save_llava_options {
  hf::weight_dtype dtype = hf::weight_dtype::as_config;  // as_config: the config's torch_dtype
  llava_layout layout = llava_layout::as_loaded;          // as_loaded: `llava_parts::layout` (legacy if unset)
  std::string copy_tokenizer_from;                        // a directory whose tokenizer files are copied ("" = none)
  std::uint64_t max_shard_bytes = 5'000'000'000;          // larger: shards + index, as Hugging Face
};

}  // namespace unirl::models::vision

BOOST_HANA_ADAPT_STRUCT(unirl::models::vision::save_llava_options, dtype, layout, copy_tokenizer_from, max_shard_bytes);

namespace unirl::models::vision {

/// A LLaVA model's parts, as `load_llava` returns them.
struct llava_parts {
  llava_config config;
  clip_vision vision_tower{nullptr};
  llava_projector projector{nullptr};
  hf::causal_lm language_model{hf::decoder_net(nullptr)};
  llava_layout layout = llava_layout::legacy;  // the tensor naming it was read with
};

namespace detail {

/// Checkpoint name prefixes of the three parts in `layout` (legacy or current).
struct llava_prefixes {
  std::string vision, projector, text_base, lm_head;  // text_base replaces the language model's "model."
};

inline llava_prefixes prefixes_of(llava_layout l) {
  if (l == llava_layout::current)
    return {"model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", ""};
  return {"vision_tower.", "multi_modal_projector.", "language_model.model.", "language_model."};
}

/// The checkpoint name of the language model's parameter `name` (`model.*` or `lm_head.weight`).
inline std::string text_tensor_name(const llava_prefixes& p, const std::string& name) {
  if (name.starts_with("model.")) return p.text_base + name.substr(6);
  return p.lm_head + name;
}

/// (checkpoint name, tensor) of the parameters of the three parts (each part's own names).
inline std::vector<std::pair<std::string, torch::Tensor>> llava_named_tensors(const named_tensors& tower,
                                                                             const named_tensors& proj,
                                                                             const named_tensors& text,
                                                                             llava_layout layout) {
  const auto p = prefixes_of(layout);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [name, t] : tower) out.emplace_back(p.vision + name, t);
  for (const auto& [name, t] : proj) out.emplace_back(p.projector + name, t);
  for (const auto& [name, t] : text) out.emplace_back(text_tensor_name(p, name), t);
  return out;
}

/// A module's parameters by name, with its LoRA adapters (if any) merged into their weights.
inline named_tensors merged_named_parameters(const torch::nn::Module& m) {
  if (lora::has_adapters(m)) return lora::merged_parameters(m);
  named_tensors out;
  for (const auto& it : m.named_parameters()) out.emplace_back(it.key(), it.value());
  return out;
}

inline torch::ScalarType llava_dtype(hf::weight_dtype d, const llava_config& c, const std::string& where) {
  switch (d) {
    case hf::weight_dtype::float32: return torch::kFloat;
    case hf::weight_dtype::bfloat16: return torch::kBFloat16;
    case hf::weight_dtype::float16: return torch::kHalf;
    case hf::weight_dtype::as_config: break;
  }
  return hf::detail::torch_dtype_of(c.torch_dtype, where);
}

}  // namespace detail

/// Loads a Hugging Face LLaVA directory (either layout; see the file comment). Errors name the
/// file and the key or tensor: an unsupported config, tensors missing, unexpected or of the
/// wrong shape (all listed at once).
inline llava_parts load_llava(const std::filesystem::path& dir, const hf::from_pretrained_options& o = {}) {
  namespace fs = std::filesystem;
  UNIRL_CHECK(fs::is_directory(dir), "vision::load_llava: ", dir.string(),
              " is not a directory (expected a Hugging Face LLaVA directory: config.json + *.safetensors)");
  llava_parts m;
  m.config = llava_config::load(dir / "config.json");
  const auto dtype = detail::llava_dtype(o.dtype, m.config, (dir / "config.json").string());
  torch::Device device(torch::kCPU);
  try {
    device = torch::Device(o.device);
  } catch (const c10::Error&) {
    throw error("unirl: vision::load_llava: device = \"" + o.device + "\": expected cpu, cuda or cuda:N");
  }
  m.vision_tower = clip_vision(m.config.vision);
  m.projector = llava_projector(m.config);
  m.language_model = hf::causal_lm(m.config.text);
  m.vision_tower->to(device, dtype);
  m.projector->to(device, dtype);
  m.language_model.net()->to(dtype);
  m.language_model.to(device);

  const io::safetensors_checkpoint ckpt(dir);
  m.layout = llava_layout::legacy;
  for (const auto& n : ckpt.names())
    if (n.starts_with("model.vision_tower.") || n.starts_with("model.multi_modal_projector.") ||
        n.starts_with("model.language_model."))
      m.layout = llava_layout::current;
  const auto own = [](const torch::nn::Module& part) {
    named_tensors out;
    for (const auto& it : part.named_parameters()) out.emplace_back(it.key(), it.value());
    return out;
  };
  const auto targets = detail::llava_named_tensors(own(*m.vision_tower.ptr()), own(*m.projector.ptr()),
                                                   m.language_model.named_parameters(), m.layout);
  const auto p = detail::prefixes_of(m.layout);
  io::load_options lo;
  for (const auto& n : ckpt.names()) {
    const bool skip = (m.config.text.tie_word_embeddings && n == p.lm_head + "lm_head.weight") ||
                      n.ends_with(".position_ids") || n.ends_with(".rotary_emb.inv_freq") ||
                      n.starts_with(p.vision + "vision_model.head.");
    if (skip) lo.ignore_unexpected.push_back(n);
  }
  io::load_into(targets, ckpt, lo);
  return m;
}

/// Writes the three parts as a Hugging Face LLaVA directory: config.json (torch_dtype set to the
/// saved dtype) and model.safetensors (or shards above `max_shard_bytes` with
/// model.safetensors.index.json), under the names of `o.layout`; a tied `lm_head` is omitted;
/// parts with LoRA adapters are written merged (W + (alpha / r) B A); then the tokenizer files of
/// `copy_tokenizer_from`. Weight files of an earlier save in `dir` are replaced.
inline void save_llava(const llava_config& config, const clip_vision& vision_tower, const llava_projector& projector,
                       const hf::causal_lm& language_model, const std::filesystem::path& dir,
                       const save_llava_options& o = {}, llava_layout loaded_as = llava_layout::legacy) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  UNIRL_CHECK(fs::is_directory(dir), "vision::save_llava: cannot create the directory ", dir.string(),
              ec ? ": " + ec.message() : std::string());
  auto c = config;
  c.text = language_model.config();
  const auto dtype = detail::llava_dtype(o.dtype, c, "vision::save_llava");
  c.torch_dtype = hf::detail::torch_dtype_name(dtype);
  c.text.torch_dtype = c.torch_dtype;
  const auto layout = o.layout == llava_layout::as_loaded ? loaded_as : o.layout;
  UNIRL_CHECK(layout != llava_layout::as_loaded, "vision::save_llava: layout: expected legacy or current");

  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  {
    torch::NoGradGuard ng;
    const auto all = detail::llava_named_tensors(detail::merged_named_parameters(*vision_tower.ptr()),
                                                 detail::merged_named_parameters(*projector.ptr()),
                                                 detail::merged_named_parameters(*language_model.net().ptr()), layout);
    for (const auto& [name, t] : all)
      tensors.emplace_back(name, t.detach().to(torch::kCPU, dtype).contiguous());
  }
  io::save_safetensors_sharded(dir, tensors, o.max_shard_bytes, {{"format", "pt"}});
  {
    std::ofstream out(dir / "config.json");
    out << c.to_json().dump(2) << "\n";
    UNIRL_CHECK(out.good(), "vision::save_llava: cannot write ", (dir / "config.json").string());
  }
  if (!o.copy_tokenizer_from.empty()) {
    const fs::path src(o.copy_tokenizer_from);
    UNIRL_CHECK(fs::is_directory(src), "vision::save_llava: copy_tokenizer_from = ", src.string(), ": not a directory");
    if (fs::equivalent(src, dir)) return;
    for (const auto name : hf::tokenizer_files) {
      const auto from = src / std::string(name);
      if (!fs::is_regular_file(from)) continue;
      fs::copy_file(from, dir / std::string(name), fs::copy_options::overwrite_existing, ec);
      UNIRL_CHECK(!ec, "vision::save_llava: cannot copy ", from.string(), " to ", dir.string(), ": ", ec.message());
    }
  }
}

/// `save_llava` of loaded parts, in the layout they were read with unless `o.layout` says otherwise.
inline void save_llava(const llava_parts& m, const std::filesystem::path& dir, const save_llava_options& o = {}) {
  save_llava(m.config, m.vision_tower, m.projector, m.language_model, dir, o, m.layout);
}

}  // namespace unirl::models::vision

#pragma once
/// \file config.hpp
/// The configs of a vision-language model: `vision_config` (a Hugging Face CLIPVisionConfig or
/// SiglipVisionConfig: the "vision_config" of a LLaVA config.json) and `llava_config` (a whole
/// LlavaForConditionalGeneration config.json: vision_config, text_config parsed by
/// `hf::decoder_config`, image_token_index, vision_feature_layer, vision_feature_select_strategy,
/// projector_hidden_act), each written back in Hugging Face's form.
///
/// ```cpp
/// namespace vision = unirl::models::vision;
/// auto c = vision::llava_config::load("llava-1.5-7b-hf");        // config.json or its directory
/// c.vision.image_size;                                             // 336
/// c.text.hidden_size;                                              // 4096 (LlamaConfig's default filled in)
/// c.vision_feature_layer;                                          // -2
/// std::ofstream("out/config.json") << c.to_json().dump(2);
/// ```
/// Hugging Face writes only the keys of a sub-config that differ from its class defaults
/// (llava-1.5's text_config has no hidden_size); the defaults of CLIPVisionConfig,
/// SiglipVisionConfig, LlamaConfig and Qwen2Config are filled in before parsing, so such files
/// load as transformers loads them. Every error names the file and the key.
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/models/hf/config.hpp>

namespace unirl::models::vision {

/// Which rows of a vision layer's hidden states become image features
/// (LLaVA's `vision_feature_select_strategy`).
enum class select_strategy {
  drop_first,  // "default": every row but the first (CLIP's class token), as LLaVA does
  full,        // "full": every row
};

}  // namespace unirl::models::vision

template <>
inline constexpr std::array unirl::enum_names<unirl::models::vision::select_strategy>{std::string_view{"default"},
                                                                                      std::string_view{"full"}};

namespace unirl::models::vision {

/// The vision tower families `clip_vision` implements.
enum class vision_family { clip, siglip };

/// Hugging Face's `model_type` of each `vision_family`.
inline constexpr std::array<std::string_view, 2> vision_model_types{"clip_vision_model", "siglip_vision_model"};

/// The activations of the vision tower's MLP and of the projector (Hugging Face's ACT2FN names).
inline constexpr std::array<std::string_view, 6> supported_activations{"quick_gelu", "gelu", "gelu_pytorch_tanh",
                                                                       "gelu_new",   "silu", "relu"};

/// "default" / "full" -> `select_strategy`; `where` is named in the error.
inline select_strategy parse_select_strategy(const std::string& s, const std::string& where) {
  if (s == "default") return select_strategy::drop_first;
  if (s == "full") return select_strategy::full;
  throw error("unirl: " + where + " = \"" + s + "\": expected \"default\" or \"full\"");
}

/// A vision tower's config (CLIPVisionConfig or SiglipVisionConfig keys).
struct vision_config {
  vision_family family = vision_family::clip;
  std::int64_t hidden_size = 768;
  std::int64_t intermediate_size = 3072;
  std::int64_t num_hidden_layers = 12;
  std::int64_t num_attention_heads = 12;
  std::int64_t image_size = 224;
  std::int64_t patch_size = 32;           // CLIPVisionConfig's default; SigLIP's is 16
  std::int64_t num_channels = 3;
  std::string hidden_act = "quick_gelu";  // CLIP's default; SigLIP's is gelu_pytorch_tanh
  double layer_norm_eps = 1e-5;           // CLIP's default; SigLIP's is 1e-6
  nlohmann::json extra = nlohmann::json::object();  // every other key, written back unchanged

  bool is_siglip() const { return family == vision_family::siglip; }
  /// Patches per side of the configured image: image_size / patch_size.
  std::int64_t grid() const { return patch_size > 0 ? image_size / patch_size : 0; }
  /// Rows of the position table: grid^2, plus the class token's for CLIP.
  std::int64_t num_positions() const { return grid() * grid() + (is_siglip() ? 0 : 1); }
  std::int64_t head_dim() const { return num_attention_heads > 0 ? hidden_size / num_attention_heads : 0; }
  std::string_view model_type() const { return vision_model_types[static_cast<std::size_t>(family)]; }

  /// The defaults of Hugging Face's config class of `family`.
  static vision_config defaults(vision_family f) {
    vision_config c;
    c.family = f;
    if (f == vision_family::siglip) {
      c.patch_size = 16;
      c.hidden_act = "gelu_pytorch_tanh";
      c.layer_norm_eps = 1e-6;
    }
    return c;
  }
  /// Parses a vision_config object (absent keys: the class defaults); `source` is named in errors.
  static vision_config from_json(const nlohmann::json& j, const std::string& source = "vision_config");
  nlohmann::json to_json() const;
  void validate(const std::string& source = "vision_config") const;
};

/// A LlavaForConditionalGeneration config.json.
struct llava_config {
  vision_config vision;
  hf::decoder_config text;
  std::int64_t image_token_index = 32000;  // the image token id standing for one image feature row (in the text vocabulary)
  std::int64_t vision_feature_layer = -2;  // index into the vision tower's num_hidden_layers + 1 hidden states
  select_strategy vision_feature_select_strategy = select_strategy::drop_first;
  std::string projector_hidden_act = "gelu";
  bool multimodal_projector_bias = true;
  std::string torch_dtype = "float32";  // dtype of the stored weights: float32, bfloat16 or float16
  nlohmann::json extra = nlohmann::json::object();  // every other key, written back unchanged

  /// Parses a config.json object; `source` (the file) is named in every error.
  static llava_config from_json(const nlohmann::json& j, const std::string& source = "config.json");
  /// Reads `file_or_dir` (config.json, or a model directory holding one).
  static llava_config load(const std::filesystem::path& file_or_dir);
  nlohmann::json to_json() const;
  void validate(const std::string& source = "llava_config") const;
  /// vision_feature_layer as an index into the hidden states [0, num_hidden_layers].
  std::int64_t feature_layer_index() const {
    return vision_feature_layer < 0 ? vision.num_hidden_layers + 1 + vision_feature_layer : vision_feature_layer;
  }
};

inline vision_config vision_config::from_json(const nlohmann::json& j, const std::string& source) {
  UNIRL_CHECK(j.is_object(), "hf config ", source, ": expected a JSON object, got ", j.type_name());
  hf::detail::config_reader r{j, source, {}};
  const auto mt = r.string("model_type", std::string(vision_model_types[0]));
  vision_family f = vision_family::clip;
  if (mt == vision_model_types[1]) f = vision_family::siglip;
  else
    UNIRL_CHECK(mt == vision_model_types[0], hf::detail::config_where(source, "model_type"), " = \"", mt,
                "\": unsupported vision tower; expected \"clip_vision_model\" or \"siglip_vision_model\"");
  auto c = defaults(f);
  c.hidden_size = r.integer("hidden_size", c.hidden_size);
  c.intermediate_size = r.integer("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = r.integer("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = r.integer("num_attention_heads", c.num_attention_heads);
  c.image_size = r.integer("image_size", c.image_size);
  c.patch_size = r.integer("patch_size", c.patch_size);
  c.num_channels = r.integer("num_channels", c.num_channels);
  c.hidden_act = r.string("hidden_act", c.hidden_act);
  c.layer_norm_eps = r.number("layer_norm_eps", c.layer_norm_eps);
  c.extra = r.unused();
  c.validate(source);
  return c;
}

inline void vision_config::validate(const std::string& source) const {
  const auto key = [&](std::string_view k) { return hf::detail::config_where(source, k); };
  for (const auto& [name, v] : {std::pair{"hidden_size", hidden_size}, std::pair{"intermediate_size", intermediate_size},
                                std::pair{"num_hidden_layers", num_hidden_layers},
                                std::pair{"num_attention_heads", num_attention_heads},
                                std::pair{"image_size", image_size}, std::pair{"patch_size", patch_size},
                                std::pair{"num_channels", num_channels}})
    UNIRL_CHECK(v >= 1, key(name), " = ", v, ": expected >= 1");
  UNIRL_CHECK(hidden_size % num_attention_heads == 0, key("hidden_size"), " = ", hidden_size,
              ": expected a multiple of num_attention_heads = ", num_attention_heads);
  UNIRL_CHECK(image_size % patch_size == 0, key("image_size"), " = ", image_size,
              ": expected a multiple of patch_size = ", patch_size);
  UNIRL_CHECK(layer_norm_eps > 0, key("layer_norm_eps"), " = ", layer_norm_eps, ": expected > 0");
  bool act = false;
  for (const auto a : supported_activations) act = act || a == hidden_act;
  UNIRL_CHECK(act, key("hidden_act"), " = \"", hidden_act,
              "\": unsupported; expected quick_gelu, gelu, gelu_pytorch_tanh, gelu_new, silu or relu");
}

inline nlohmann::json vision_config::to_json() const {
  nlohmann::json j = extra;
  j["model_type"] = std::string(model_type());
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["image_size"] = image_size;
  j["patch_size"] = patch_size;
  j["num_channels"] = num_channels;
  j["hidden_act"] = hidden_act;
  j["layer_norm_eps"] = layer_norm_eps;
  return j;
}

namespace detail {

/// A LLaVA text_config with the defaults of its transformers config class filled in (Hugging Face
/// writes only the keys that differ from them) and `architectures` derived from `model_type`.
inline nlohmann::json complete_text_config(nlohmann::json t, const std::string& source) {
  UNIRL_CHECK(t.is_object(), hf::detail::config_where(source, "text_config"), " = ", t.dump(),
              ": expected a JSON object");
  const auto mt = t.value("model_type", std::string("llama"));
  nlohmann::json d;
  if (mt == "llama")
    d = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 32000}, {"hidden_size", 4096},
         {"intermediate_size", 11008}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
         {"max_position_embeddings", 2048}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
         {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
  else if (mt == "qwen2")
    d = {{"architectures", {"Qwen2ForCausalLM"}}, {"vocab_size", 151936}, {"hidden_size", 4096},
         {"intermediate_size", 22016}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
         {"num_key_value_heads", 32}, {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6},
         {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
  else
    throw error("unirl: " + hf::detail::config_where(source, "text_config") + ".model_type = \"" + mt +
                "\": unsupported language model; expected \"llama\" or \"qwen2\"");
  t["model_type"] = mt;
  for (auto it = d.begin(); it != d.end(); ++it)
    if (!t.contains(it.key()) || (it.key() == "architectures" && t[it.key()].is_null())) t[it.key()] = it.value();
  return t;
}

}  // namespace detail

inline llava_config llava_config::from_json(const nlohmann::json& j, const std::string& source) {
  UNIRL_CHECK(j.is_object(), "hf config ", source, ": expected a JSON object, got ", j.type_name());
  hf::detail::config_reader r{j, source, {}};
  llava_config c;
  if (const auto* a = r.find("architectures")) {
    UNIRL_CHECK(a->is_array() && !a->empty() && a->front().is_string() &&
                    a->front().get<std::string>() == "LlavaForConditionalGeneration",
                hf::detail::config_where(source, "architectures"), " = ", a->dump(),
                ": expected [\"LlavaForConditionalGeneration\"]");
  }
  {
    const auto mt = r.string("model_type", "llava");
    UNIRL_CHECK(mt == "llava", hf::detail::config_where(source, "model_type"), " = \"", mt, "\": expected \"llava\"");
  }
  r.unsupported_unless("quantization_config", nullptr, "quantized weights are not supported");
  c.torch_dtype = r.string("torch_dtype", "float32");
  {
    const auto* v = r.find("vision_config");
    UNIRL_CHECK(v != nullptr, hf::detail::config_where(source, "vision_config"),
                " is missing: expected the vision tower's config object");
    c.vision = vision_config::from_json(*v, source + ": vision_config");
  }
  {
    const auto* t = r.find("text_config");
    UNIRL_CHECK(t != nullptr, hf::detail::config_where(source, "text_config"),
                " is missing: expected the language model's config object");
    auto text = detail::complete_text_config(*t, source);
    if (!text.contains("torch_dtype") || text["torch_dtype"].is_null()) text["torch_dtype"] = c.torch_dtype;
    c.text = hf::decoder_config::from_json(text, source + ": text_config");
  }
  if (j.contains("image_token_index") || !j.contains("image_token_id"))
    c.image_token_index = r.integer("image_token_index", 32000);
  else
    c.image_token_index = r.integer("image_token_id");
  r.used.emplace_back("image_token_id");
  {
    const auto* v = r.find("vision_feature_layer");
    if (v) {
      UNIRL_CHECK(v->is_number_integer(), hf::detail::config_where(source, "vision_feature_layer"), " = ", v->dump(),
                  ": expected an integer (a list of layers is not supported)");
      c.vision_feature_layer = v->get<std::int64_t>();
    }
  }
  c.vision_feature_select_strategy = parse_select_strategy(
      r.string("vision_feature_select_strategy", "default"),
      hf::detail::config_where(source, "vision_feature_select_strategy"));
  c.projector_hidden_act = r.string("projector_hidden_act", "gelu");
  c.multimodal_projector_bias = r.boolean("multimodal_projector_bias", true);
  c.extra = r.unused();
  c.validate(source);
  return c;
}

inline void llava_config::validate(const std::string& source) const {
  vision.validate(source + ": vision_config");
  text.validate(source + ": text_config");
  const auto key = [&](std::string_view k) { return hf::detail::config_where(source, k); };
  UNIRL_CHECK(image_token_index >= 0 && image_token_index < text.vocab_size, key("image_token_index"), " = ",
              image_token_index, ": expected an id in [0, text_config.vocab_size = ", text.vocab_size, ")");
  UNIRL_CHECK(vision_feature_layer >= -(vision.num_hidden_layers + 1) && vision_feature_layer <= vision.num_hidden_layers,
              key("vision_feature_layer"), " = ", vision_feature_layer, ": expected in [",
              -(vision.num_hidden_layers + 1), ", ", vision.num_hidden_layers,
              "] (an index into the embeddings and the outputs of the vision_config.num_hidden_layers = ",
              vision.num_hidden_layers, " layers)");
  bool act = false;
  for (const auto a : supported_activations) act = act || a == projector_hidden_act;
  UNIRL_CHECK(act, key("projector_hidden_act"), " = \"", projector_hidden_act,
              "\": unsupported; expected quick_gelu, gelu, gelu_pytorch_tanh, gelu_new, silu or relu");
  UNIRL_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16" || torch_dtype == "float16", key("torch_dtype"),
              " = \"", torch_dtype, "\": expected float32, bfloat16 or float16");
}

inline llava_config llava_config::load(const std::filesystem::path& file_or_dir) {
  const auto [j, file] = hf::detail::read_config_json(file_or_dir, "LLaVA model");
  return from_json(j, file);
}

inline nlohmann::json llava_config::to_json() const {
  nlohmann::json j = extra;
  j["architectures"] = nlohmann::json::array({"LlavaForConditionalGeneration"});
  j["model_type"] = "llava";
  j["torch_dtype"] = torch_dtype;
  j["vision_config"] = vision.to_json();
  j["text_config"] = text.to_json();
  j["image_token_index"] = image_token_index;
  j["vision_feature_layer"] = vision_feature_layer;
  j["vision_feature_select_strategy"] = std::string(enum_to_string(vision_feature_select_strategy));
  j["projector_hidden_act"] = projector_hidden_act;
  j["multimodal_projector_bias"] = multimodal_projector_bias;
  return j;
}

}  // namespace unirl::models::vision

#pragma once
/// \file config.hpp
/// The diffusers layout's JSON files: `model_index.json` and the component configs of Stable
/// Diffusion 3 / 3.5 (`transformer/config.json`, `vae/config.json`, `text_encoder*/config.json`,
/// `scheduler/scheduler_config.json`), each parsed into a struct and written back.
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// auto t = df::sd3_transformer_config::load("sd3/transformer");     // the folder or its config.json
/// auto index = df::model_index::load("sd3");                        // components and their classes
/// std::ofstream("out/transformer/config.json") << t.to_json().dump(2);
/// ```
/// Every key of a file must be one this implementation knows: an unknown key, a known one with
/// a value it does not implement (`dual_attention_layers` other than empty, `qk_norm` other than
/// null or "rms_norm", dynamic shifting, ...), a wrong type or a missing required key is a
/// `unirl::error` naming the file and the key. Keys starting with '_' (`_class_name`,
/// `_diffusers_version`, `_name_or_path`) are metadata; `_class_name` must be the component's class.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>

namespace unirl::models::diffusers {

namespace detail {

inline nlohmann::json read_json(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  UNIRL_CHECK(static_cast<bool>(in), "diffusers: cannot open ", file.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    auto j = nlohmann::json::parse(ss.str());
    UNIRL_CHECK(j.is_object(), "diffusers: ", file.string(), ": expected a JSON object");
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw error("unirl: diffusers: " + file.string() + ": invalid JSON: " + e.what());
  }
}

/// `file_or_dir` itself, or `file_or_dir / name` when it is a directory.
inline std::filesystem::path config_file(const std::filesystem::path& file_or_dir, const char* name) {
  std::error_code ec;
  return std::filesystem::is_directory(file_or_dir, ec) ? file_or_dir / name : file_or_dir;
}

/// Reads the keys of one config object; `finish` rejects every key nobody read.
class keys {
 public:
  keys(const nlohmann::json& j, std::string source) : j_(j), source_(std::move(source)) {}

  std::string where(const std::string& key) const { return "diffusers config " + source_ + ": key '" + key + "'"; }

  const nlohmann::json* find(const std::string& key) {
    used_.insert(key);
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  std::int64_t integer(const std::string& key, std::optional<std::int64_t> def = std::nullopt) {
    const auto* v = find(key);
    UNIRL_CHECK(v || def, where(key), " is missing: expected an integer");
    if (!v) return *def;
    UNIRL_CHECK(v->is_number_integer(), where(key), " = ", v->dump(), ": expected an integer");
    return v->get<std::int64_t>();
  }
  std::int64_t positive(const std::string& key, std::optional<std::int64_t> def = std::nullopt) {
    const auto v = integer(key, def);
    UNIRL_CHECK(v >= 1, where(key), " = ", v, ": expected >= 1");
    return v;
  }
  double number(const std::string& key, std::optional<double> def = std::nullopt) {
    const auto* v = find(key);
    UNIRL_CHECK(v || def, where(key), " is missing: expected a number");
    if (!v) return *def;
    UNIRL_CHECK(v->is_number(), where(key), " = ", v->dump(), ": expected a number");
    return v->get<double>();
  }
  bool boolean(const std::string& key, bool def) {
    const auto* v = find(key);
    if (!v) return def;
    UNIRL_CHECK(v->is_boolean(), where(key), " = ", v->dump(), ": expected true or false");
    return v->get<bool>();
  }
  std::string string(const std::string& key, std::optional<std::string> def = std::nullopt) {
    const auto* v = find(key);
    UNIRL_CHECK(v || def, where(key), " is missing: expected a string");
    if (!v) return *def;
    UNIRL_CHECK(v->is_string(), where(key), " = ", v->dump(), ": expected a string");
    return v->get<std::string>();
  }
  std::vector<std::int64_t> integers(const std::string& key) {
    const auto* v = find(key);
    UNIRL_CHECK(v && v->is_array() && !v->empty(), where(key), ": expected a non-empty list of integers");
    std::vector<std::int64_t> out;
    for (const auto& e : *v) {
      UNIRL_CHECK(e.is_number_integer() && e.get<std::int64_t>() >= 1, where(key), " = ", v->dump(),
                  ": expected a list of integers >= 1");
      out.push_back(e.get<std::int64_t>());
    }
    return out;
  }
  std::vector<std::string> strings(const std::string& key) {
    const auto* v = find(key);
    UNIRL_CHECK(v && v->is_array(), where(key), ": expected a list of strings");
    std::vector<std::string> out;
    for (const auto& e : *v) {
      UNIRL_CHECK(e.is_string(), where(key), " = ", v->dump(), ": expected a list of strings");
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  /// A key this implementation reads but supports only at `expected` (null also allowed).
  void fixed(const std::string& key, const nlohmann::json& expected, const char* why) {
    const auto* v = find(key);
    UNIRL_CHECK(!v || *v == expected, where(key), " = ", v ? v->dump() : "", ": unsupported (", why,
                "); expected ", expected.dump(), " or null");
  }
  /// A key whose value does not change the computation (dropout rates, initialisation scales).
  void ignored(const std::string& key) { used_.insert(key); }
  void class_name(const std::string& expected) {
    const auto* v = find("_class_name");
    if (v) UNIRL_CHECK(v->is_string() && v->get<std::string>() == expected, where("_class_name"), " = ", v->dump(),
                       ": expected \"", expected, "\"");
  }
  /// Throws naming the first key nobody read (metadata keys starting with '_' excepted).
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (!it.key().empty() && it.key()[0] == '_') continue;
      UNIRL_CHECK(used_.count(it.key()) != 0, where(it.key()), " = ", it.value().dump(),
                  ": unknown to unirl's implementation (an unsupported feature?)");
    }
  }

 private:
  const nlohmann::json& j_;
  std::string source_;
  std::set<std::string> used_;
};

inline nlohmann::json metadata(const char* cls) {
  return nlohmann::json{{"_class_name", cls}, {"_diffusers_version", "0.32.0"}};
}

}  // namespace detail

/// `SD3Transformer2DModel`'s config (Stable Diffusion 3 / 3.5's MMDiT).
struct sd3_transformer_config {
  std::int64_t sample_size = 128;            // latent size the position table's base is set for
  std::int64_t patch_size = 2;
  std::int64_t in_channels = 16;
  std::int64_t out_channels = 16;            // null in the file: in_channels
  std::int64_t num_layers = 18;
  std::int64_t attention_head_dim = 64;
  std::int64_t num_attention_heads = 18;
  std::int64_t joint_attention_dim = 4096;   // width of the text tokens (T5's; CLIP's padded to it)
  std::int64_t caption_projection_dim = 1152;
  std::int64_t pooled_projection_dim = 2048;
  std::int64_t pos_embed_max_size = 96;
  bool qk_rms_norm = false;                  // qk_norm: null (SD3) or "rms_norm" (SD3.5)

  std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }

  void validate(const std::string& source = "sd3_transformer_config") const {
    UNIRL_CHECK(caption_projection_dim == inner_dim(), "diffusers config ", source, ": caption_projection_dim = ",
                caption_projection_dim, ": expected num_attention_heads * attention_head_dim = ", inner_dim());
    UNIRL_CHECK(sample_size % patch_size == 0 && sample_size / patch_size <= pos_embed_max_size, "diffusers config ",
                source, ": sample_size = ", sample_size, ": expected a multiple of patch_size = ", patch_size,
                " with at most pos_embed_max_size = ", pos_embed_max_size, " patches per side");
  }

  static sd3_transformer_config from_json(const nlohmann::json& j, const std::string& source) {
    detail::keys k(j, source);
    k.class_name("SD3Transformer2DModel");
    sd3_transformer_config c;
    c.sample_size = k.positive("sample_size", 128);
    c.patch_size = k.positive("patch_size", 2);
    c.in_channels = k.positive("in_channels", 16);
    c.out_channels = k.find("out_channels") ? k.positive("out_channels") : c.in_channels;
    c.num_layers = k.positive("num_layers", 18);
    c.attention_head_dim = k.positive("attention_head_dim", 64);
    c.num_attention_heads = k.positive("num_attention_heads", 18);
    c.joint_attention_dim = k.positive("joint_attention_dim", 4096);
    c.caption_projection_dim = k.positive("caption_projection_dim", 1152);
    c.pooled_projection_dim = k.positive("pooled_projection_dim", 2048);
    c.pos_embed_max_size = k.positive("pos_embed_max_size", 96);
    if (const auto* q = k.find("qk_norm")) {
      UNIRL_CHECK(q->is_string() && q->get<std::string>() == "rms_norm", k.where("qk_norm"), " = ", q->dump(),
                  ": unsupported; expected null or \"rms_norm\"");
      c.qk_rms_norm = true;
    }
    if (const auto* d = k.find("dual_attention_layers"))
      UNIRL_CHECK(d->is_array() && d->empty(), k.where("dual_attention_layers"), " = ", d->dump(),
                  ": unsupported (SD3.5 Medium's MMDiT-X dual attention); expected []");
    k.finish();
    c.validate(source);
    return c;
  }
  static sd3_transformer_config load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "config.json");
    return from_json(detail::read_json(f), f.string());
  }
  nlohmann::json to_json() const {
    auto j = detail::metadata("SD3Transformer2DModel");
    j["sample_size"] = sample_size;
    j["patch_size"] = patch_size;
    j["in_channels"] = in_channels;
    j["out_channels"] = out_channels;
    j["num_layers"] = num_layers;
    j["attention_head_dim"] = attention_head_dim;
    j["num_attention_heads"] = num_attention_heads;
    j["joint_attention_dim"] = joint_attention_dim;
    j["caption_projection_dim"] = caption_projection_dim;
    j["pooled_projection_dim"] = pooled_projection_dim;
    j["pos_embed_max_size"] = pos_embed_max_size;
    j["qk_norm"] = qk_rms_norm ? nlohmann::json("rms_norm") : nlohmann::json(nullptr);
    j["dual_attention_layers"] = nlohmann::json::array();
    return j;
  }
};

/// `AutoencoderKL`'s config: DownEncoderBlock2D / UpDecoderBlock2D stages, SiLU, mid-block attention.
struct autoencoder_kl_config {
  std::int64_t in_channels = 3;
  std::int64_t out_channels = 3;
  std::vector<std::int64_t> block_out_channels{128, 256, 512, 512};
  std::int64_t layers_per_block = 2;
  std::int64_t latent_channels = 16;
  std::int64_t norm_num_groups = 32;
  std::int64_t sample_size = 1024;
  double scaling_factor = 1.5305;
  double shift_factor = 0.0609;   // null in the file: 0
  bool use_quant_conv = false;
  bool use_post_quant_conv = false;
  bool mid_block_add_attention = true;

  static autoencoder_kl_config from_json(const nlohmann::json& j, const std::string& source) {
    detail::keys k(j, source);
    k.class_name("AutoencoderKL");
    autoencoder_kl_config c;
    c.in_channels = k.positive("in_channels", 3);
    c.out_channels = k.positive("out_channels", 3);
    c.block_out_channels = k.integers("block_out_channels");
    const auto n = c.block_out_channels.size();
    const auto down = k.strings("down_block_types"), up = k.strings("up_block_types");
    UNIRL_CHECK(down.size() == n && up.size() == n, k.where("down_block_types"), ": ", down.size(), " down and ",
                up.size(), " up blocks: expected one each per block_out_channels entry (", n, ")");
    for (const auto& d : down)
      UNIRL_CHECK(d == "DownEncoderBlock2D", k.where("down_block_types"), " has \"", d,
                  "\": unsupported; expected DownEncoderBlock2D");
    for (const auto& u : up)
      UNIRL_CHECK(u == "UpDecoderBlock2D", k.where("up_block_types"), " has \"", u,
                  "\": unsupported; expected UpDecoderBlock2D");
    c.layers_per_block = k.positive("layers_per_block", 1);
    c.latent_channels = k.positive("latent_channels", 4);
    c.norm_num_groups = k.positive("norm_num_groups", 32);
    for (auto ch : c.block_out_channels)
      UNIRL_CHECK(ch % c.norm_num_groups == 0, k.where("norm_num_groups"), " = ", c.norm_num_groups,
                  ": expected to divide every block_out_channels entry (", ch, " does not)");
    c.sample_size = k.positive("sample_size", 32);
    c.scaling_factor = k.number("scaling_factor", 0.18215);
    UNIRL_CHECK(c.scaling_factor > 0.0, k.where("scaling_factor"), " = ", c.scaling_factor, ": expected > 0");
    c.shift_factor = k.number("shift_factor", 0.0);
    c.use_quant_conv = k.boolean("use_quant_conv", true);
    c.use_post_quant_conv = k.boolean("use_post_quant_conv", true);
    c.mid_block_add_attention = k.boolean("mid_block_add_attention", true);
    k.fixed("act_fn", "silu", "the only activation implemented");
    k.fixed("latents_mean", nullptr, "per-channel latent statistics");
    k.fixed("latents_std", nullptr, "per-channel latent statistics");
    k.ignored("force_upcast");  // a dtype hint for half-precision pipelines
    k.finish();
    return c;
  }
  static autoencoder_kl_config load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "config.json");
    return from_json(detail::read_json(f), f.string());
  }
  nlohmann::json to_json() const {
    auto j = detail::metadata("AutoencoderKL");
    j["in_channels"] = in_channels;
    j["out_channels"] = out_channels;
    j["block_out_channels"] = block_out_channels;
    j["down_block_types"] = std::vector<std::string>(block_out_channels.size(), "DownEncoderBlock2D");
    j["up_block_types"] = std::vector<std::string>(block_out_channels.size(), "UpDecoderBlock2D");
    j["layers_per_block"] = layers_per_block;
    j["act_fn"] = "silu";
    j["latent_channels"] = latent_channels;
    j["norm_num_groups"] = norm_num_groups;
    j["sample_size"] = sample_size;
    j["scaling_factor"] = scaling_factor;
    j["shift_factor"] = shift_factor;
    j["use_quant_conv"] = use_quant_conv;
    j["use_post_quant_conv"] = use_post_quant_conv;
    j["mid_block_add_attention"] = mid_block_add_attention;
    j["force_upcast"] = true;
    return j;
  }
};

/// `CLIPTextModelWithProjection`'s config (transformers' CLIPTextConfig).
struct clip_text_config {
  std::int64_t vocab_size = 49408;
  std::int64_t hidden_size = 768;
  std::int64_t intermediate_size = 3072;
  std::int64_t projection_dim = 768;
  std::int64_t num_hidden_layers = 12;
  std::int64_t num_attention_heads = 12;
  std::int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  std::int64_t bos_token_id = 49406;
  std::int64_t eos_token_id = 49407;   // 2: the legacy rule (the pooled row is the largest id's)
  std::int64_t pad_token_id = 1;

  static clip_text_config from_json(const nlohmann::json& j, const std::string& source) {
    detail::keys k(j, source);
    clip_text_config c;
    if (const auto* a = k.find("architectures"))
      UNIRL_CHECK(a->is_array() && a->size() == 1 && (*a)[0] == "CLIPTextModelWithProjection",
                  k.where("architectures"), " = ", a->dump(), ": expected [\"CLIPTextModelWithProjection\"]");
    k.fixed("model_type", "clip_text_model", "a CLIP text encoder");
    c.vocab_size = k.positive("vocab_size", 49408);
    c.hidden_size = k.positive("hidden_size", 512);
    c.intermediate_size = k.positive("intermediate_size", 2048);
    c.projection_dim = k.positive("projection_dim", 512);
    c.num_hidden_layers = k.positive("num_hidden_layers", 12);
    c.num_attention_heads = k.positive("num_attention_heads", 8);
    UNIRL_CHECK(c.hidden_size % c.num_attention_heads == 0, k.where("num_attention_heads"), " = ",
                c.num_attention_heads, ": expected to divide hidden_size = ", c.hidden_size);
    c.max_position_embeddings = k.positive("max_position_embeddings", 77);
    c.hidden_act = k.string("hidden_act", "quick_gelu");
    UNIRL_CHECK(c.hidden_act == "quick_gelu" || c.hidden_act == "gelu", k.where("hidden_act"), " = \"", c.hidden_act,
                "\": unsupported; expected quick_gelu or gelu");
    c.layer_norm_eps = k.number("layer_norm_eps", 1e-5);
    c.bos_token_id = k.integer("bos_token_id", 49406);
    c.eos_token_id = k.integer("eos_token_id", 49407);
    c.pad_token_id = k.integer("pad_token_id", 1);
    if (const auto* d = k.find("torch_dtype"))  // the files' dtype; load_sd3's dtype is the weights'
      UNIRL_CHECK(*d == "float32" || *d == "bfloat16" || *d == "float16", k.where("torch_dtype"), " = ", d->dump(),
                  ": expected \"float32\", \"bfloat16\" or \"float16\"");
    for (const char* key : {"dropout", "attention_dropout", "initializer_range", "initializer_factor",
                            "transformers_version"})
      k.ignored(key);
    k.finish();
    return c;
  }
  static clip_text_config load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "config.json");
    return from_json(detail::read_json(f), f.string());
  }
  nlohmann::json to_json() const {
    return {{"architectures", {"CLIPTextModelWithProjection"}},
            {"model_type", "clip_text_model"},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"projection_dim", projection_dim},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"max_position_embeddings", max_position_embeddings},
            {"hidden_act", hidden_act},
            {"layer_norm_eps", layer_norm_eps},
            {"bos_token_id", bos_token_id},
            {"eos_token_id", eos_token_id},
            {"pad_token_id", pad_token_id},
            {"torch_dtype", "float32"}};
  }
};

/// `FlowMatchEulerDiscreteScheduler`'s config: static shift only.
struct flow_match_scheduler_config {
  std::int64_t num_train_timesteps = 1000;
  double shift = 3.0;

  static flow_match_scheduler_config from_json(const nlohmann::json& j, const std::string& source) {
    detail::keys k(j, source);
    k.class_name("FlowMatchEulerDiscreteScheduler");
    flow_match_scheduler_config c;
    c.num_train_timesteps = k.positive("num_train_timesteps", 1000);
    UNIRL_CHECK(c.num_train_timesteps >= 2, k.where("num_train_timesteps"), " = ", c.num_train_timesteps,
                ": expected >= 2");
    c.shift = k.number("shift", 1.0);
    UNIRL_CHECK(c.shift > 0.0, k.where("shift"), " = ", c.shift, ": expected > 0");
    k.fixed("use_dynamic_shifting", false, "resolution-dependent shift (FLUX)");
    k.fixed("invert_sigmas", false, "inverted sigmas");
    k.fixed("use_karras_sigmas", false, "Karras sigmas");
    k.fixed("use_exponential_sigmas", false, "exponential sigmas");
    k.fixed("use_beta_sigmas", false, "beta sigmas");
    k.fixed("stochastic_sampling", false, "stochastic sampling");
    k.fixed("shift_terminal", nullptr, "a stretched terminal sigma");
    k.fixed("time_shift_type", "exponential", "dynamic shifting only");
    for (const char* key : {"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len"})
      k.ignored(key);  // read by dynamic shifting only, which is off
    k.finish();
    return c;
  }
  static flow_match_scheduler_config load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "scheduler_config.json");
    return from_json(detail::read_json(f), f.string());
  }
  nlohmann::json to_json() const {
    auto j = detail::metadata("FlowMatchEulerDiscreteScheduler");
    j["num_train_timesteps"] = num_train_timesteps;
    j["shift"] = shift;
    j["use_dynamic_shifting"] = false;
    return j;
  }
};

/// `model_index.json`: the pipeline class and each component's (library, class), or null for an
/// absent one (SD3 without T5: `text_encoder_3: [null, null]`).
struct model_index {
  std::string class_name;
  std::map<std::string, std::optional<std::pair<std::string, std::string>>> components;

  /// The (library, class) of `name`, or nullopt when absent or null.
  std::optional<std::pair<std::string, std::string>> component(const std::string& name) const {
    const auto it = components.find(name);
    return it == components.end() ? std::nullopt : it->second;
  }

  static model_index from_json(const nlohmann::json& j, const std::string& source) {
    model_index m;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const auto& key = it.key();
      if (key == "_class_name") {
        UNIRL_CHECK(it->is_string(), "diffusers ", source, ": key '_class_name' = ", it->dump(), ": expected a string");
        m.class_name = it->get<std::string>();
        continue;
      }
      if (!key.empty() && key[0] == '_') continue;
      const auto& v = it.value();
      const bool null_pair = v.is_array() && v.size() == 2 && v[0].is_null() && v[1].is_null();
      if (v.is_null() || null_pair) {
        m.components[key] = std::nullopt;
        continue;
      }
      UNIRL_CHECK(v.is_array() && v.size() == 2 && v[0].is_string() && v[1].is_string(), "diffusers ", source,
                  ": key '", key, "' = ", v.dump(), ": expected [library, class] or [null, null]");
      m.components[key] = std::make_pair(v[0].get<std::string>(), v[1].get<std::string>());
    }
    UNIRL_CHECK(!m.class_name.empty(), "diffusers ", source, ": key '_class_name' is missing");
    return m;
  }
  static model_index load(const std::filesystem::path& file_or_dir) {
    const auto f = detail::config_file(file_or_dir, "model_index.json");
    return from_json(detail::read_json(f), f.string());
  }
  nlohmann::json to_json() const {
    auto j = detail::metadata(class_name.c_str());
    for (const auto& [name, c] : components)
      j[name] = c ? nlohmann::json{c->first, c->second} : nlohmann::json{nullptr, nullptr};
    return j;
  }
};

}  // namespace unirl::models::diffusers

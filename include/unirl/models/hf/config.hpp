#pragma once
/// \file config.hpp
/// `decoder_config`: a Hugging Face `config.json` of a decoder-only language model
/// (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel) parsed into one
/// struct, and written back in Hugging Face's form.
///
/// ```cpp
/// auto c = unirl::models::hf::decoder_config::load("Qwen2.5-0.5B/config.json");   // or the directory
/// c.num_hidden_layers;                         // GPT-2's n_layer lands here too
/// std::ofstream("out/config.json") << c.to_json().dump(2);
/// ```
/// Every error names the file and the key: a missing required key, a value of the wrong type or
/// range, an architecture other than the four, and the features this implementation does not
/// have (rope_scaling other than null, sliding-window attention, quantized weights, ...).
#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>

namespace unirl::models::hf {

/// The decoder architectures `hf::causal_lm` implements.
enum class architecture { llama, qwen2, qwen3, gpt2 };

/// Hugging Face's class name of each `architecture` (`architectures[0]` in config.json).
inline constexpr std::array<std::string_view, 4> architecture_names{"LlamaForCausalLM", "Qwen2ForCausalLM",
                                                                    "Qwen3ForCausalLM", "GPT2LMHeadModel"};
/// Hugging Face's `model_type` of each `architecture`.
inline constexpr std::array<std::string_view, 4> model_types{"llama", "qwen2", "qwen3", "gpt2"};

/// A decoder's `config.json`. Field names follow the Llama family; GPT-2's keys map onto them
/// (n_embd -> hidden_size, n_layer -> num_hidden_layers, n_head -> num_attention_heads,
/// n_positions -> max_position_embeddings, n_inner -> intermediate_size (null: 4 * n_embd),
/// layer_norm_epsilon -> norm_eps, activation_function -> hidden_act).
struct decoder_config {
  architecture arch = architecture::llama;
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;   // 0 or absent: num_attention_heads (no GQA); see kv_heads()
  std::int64_t head_dim = 0;              // 0 or absent: hidden_size / num_attention_heads (Qwen3: required)
  std::int64_t max_position_embeddings = 0;
  double norm_eps = 1e-6;                 // rms_norm_eps (Llama family), layer_norm_epsilon (GPT-2)
  double rope_theta = 10000.0;            // Llama family only
  double initializer_range = 0.02;        // std of the random initialisation (a model built from a config alone)
  bool tie_word_embeddings = false;       // lm_head shares the token embedding (GPT-2: default true)
  bool attention_bias = false;            // Llama / Qwen3 key: q, k, v, o biases (Qwen2 and GPT-2: see qkv_bias())
  bool mlp_bias = false;                  // Llama key: gate, up, down biases
  std::string hidden_act = "silu";        // Llama family: silu; GPT-2: gelu_new, gelu_pytorch_tanh or gelu
  std::string torch_dtype = "float32";    // dtype of the stored weights: float32, bfloat16 or float16
  std::optional<std::int64_t> bos_token_id, pad_token_id;
  std::vector<std::int64_t> eos_token_id;  // one id or a list (written back as it was read)
  bool eos_is_list = false;
  nlohmann::json extra = nlohmann::json::object();  // every other key of the source, written back unchanged

  bool is_gpt2() const { return arch == architecture::gpt2; }
  /// Key/value heads: `num_key_value_heads`, or `num_attention_heads` when 0 (GPT-2: always).
  std::int64_t kv_heads() const {
    return is_gpt2() || num_key_value_heads == 0 ? num_attention_heads : num_key_value_heads;
  }
  /// Size of one attention head: `head_dim`, or hidden_size / num_attention_heads when 0 (GPT-2: always).
  std::int64_t head_size() const {
    return !is_gpt2() && head_dim > 0 ? head_dim : num_attention_heads > 0 ? hidden_size / num_attention_heads : 0;
  }
  /// Whether q, k, v have biases: Qwen2 and GPT-2 always, Llama and Qwen3 with `attention_bias`.
  bool qkv_bias() const { return arch == architecture::qwen2 || is_gpt2() || attention_bias; }
  /// Whether the output projection has a bias: GPT-2 always, Llama and Qwen3 with `attention_bias`.
  bool o_bias() const { return is_gpt2() || (arch != architecture::qwen2 && attention_bias); }
  /// Whether the MLP's projections have biases: GPT-2 always, Llama with `mlp_bias`.
  bool mlp_biases() const { return is_gpt2() || (arch == architecture::llama && mlp_bias); }
  std::string_view architecture_name() const { return architecture_names[static_cast<std::size_t>(arch)]; }

  /// Parses a config.json object; `source` (the file) is named in every error.
  static decoder_config from_json(const nlohmann::json& j, const std::string& source = "config.json");
  /// Reads `file_or_dir` (config.json, or a model directory holding one).
  static decoder_config load(const std::filesystem::path& file_or_dir);
  /// The config.json object in Hugging Face's form (GPT-2's own key names for GPT-2).
  nlohmann::json to_json() const;
  /// Checks sizes and head counts; `source` is named in the error.
  void validate(const std::string& source = "decoder_config") const;
};

namespace detail {

inline std::string config_where(const std::string& source, std::string_view key) {
  return "hf config " + source + ": key '" + std::string(key) + "'";
}

// Reads keys of a config object, remembering which it consumed (the rest go to `extra`).
struct config_reader {
  const nlohmann::json& j;
  const std::string& source;
  std::vector<std::string> used;

  const nlohmann::json* find(std::string_view key) {
    used.emplace_back(key);
    const auto it = j.find(std::string(key));
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  std::int64_t integer(std::string_view key, std::optional<std::int64_t> def = std::nullopt) {
    const auto* v = find(key);
    if (!v) {
      UNIRL_CHECK(def.has_value(), config_where(source, key), " is missing: expected an integer");
      return *def;
    }
    UNIRL_CHECK(v->is_number_integer(), config_where(source, key), " = ", v->dump(), ": expected an integer");
    return v->get<std::int64_t>();
  }
  double number(std::string_view key, double def) {
    const auto* v = find(key);
    if (!v) return def;
    UNIRL_CHECK(v->is_number(), config_where(source, key), " = ", v->dump(), ": expected a number");
    return v->get<double>();
  }
  bool boolean(std::string_view key, bool def) {
    const auto* v = find(key);
    if (!v) return def;
    UNIRL_CHECK(v->is_boolean(), config_where(source, key), " = ", v->dump(), ": expected true or false");
    return v->get<bool>();
  }
  std::string string(std::string_view key, const std::string& def) {
    const auto* v = find(key);
    if (!v) return def;
    UNIRL_CHECK(v->is_string(), config_where(source, key), " = ", v->dump(), ": expected a string");
    return v->get<std::string>();
  }
  std::optional<std::int64_t> optional_integer(std::string_view key) {
    const auto* v = find(key);
    if (!v) return std::nullopt;
    UNIRL_CHECK(v->is_number_integer(), config_where(source, key), " = ", v->dump(), ": expected an integer or null");
    return v->get<std::int64_t>();
  }
  // The keys of the object not read so far, with their values (a config's `extra`).
  nlohmann::json unused() const {
    nlohmann::json out = nlohmann::json::object();
    for (auto it = j.begin(); it != j.end(); ++it)
      if (std::find(used.begin(), used.end(), it.key()) == used.end()) out[it.key()] = it.value();
    return out;
  }
  // A key whose only supported value is its default: rejected (naming it) when set to anything else.
  void unsupported_unless(std::string_view key, const nlohmann::json& supported, std::string_view why) {
    const auto it = j.find(std::string(key));
    if (it == j.end()) return;
    used.emplace_back(key);
    UNIRL_CHECK(*it == supported || (supported.is_null() && it->is_null()), config_where(source, key), " = ",
                it->dump(), ": unsupported (", why, "); expected ", supported.dump());
  }
};

}  // namespace detail

inline decoder_config decoder_config::from_json(const nlohmann::json& j, const std::string& source) {
  UNIRL_CHECK(j.is_object(), "hf config ", source, ": expected a JSON object, got ", j.type_name());
  detail::config_reader r{j, source, {}};
  decoder_config c;
  {
    const auto* a = r.find("architectures");
    UNIRL_CHECK(a != nullptr, detail::config_where(source, "architectures"),
                " is missing: expected a list naming one of LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                "GPT2LMHeadModel");
    UNIRL_CHECK(a->is_array() && !a->empty() && a->front().is_string(), detail::config_where(source, "architectures"),
                " = ", a->dump(), ": expected a non-empty list of class names");
    const auto name = a->front().get<std::string>();
    bool found = false;
    for (std::size_t i = 0; i < architecture_names.size(); ++i)
      if (architecture_names[i] == name) c.arch = static_cast<architecture>(i), found = true;
    UNIRL_CHECK(found, detail::config_where(source, "architectures"), "[0] = \"", name,
                "\": unsupported architecture; expected one of LlamaForCausalLM, Qwen2ForCausalLM, "
                "Qwen3ForCausalLM, GPT2LMHeadModel");
  }
  {
    const auto mt = r.string("model_type", std::string(model_types[static_cast<std::size_t>(c.arch)]));
    UNIRL_CHECK(mt == model_types[static_cast<std::size_t>(c.arch)], detail::config_where(source, "model_type"),
                " = \"", mt, "\" does not match architectures[0] = ", c.architecture_name(), " (expected \"",
                model_types[static_cast<std::size_t>(c.arch)], "\")");
  }
  r.unsupported_unless("quantization_config", nullptr, "quantized weights are not supported");
  c.torch_dtype = r.string("torch_dtype", "float32");
  c.vocab_size = r.integer("vocab_size");
  c.initializer_range = r.number("initializer_range", 0.02);
  c.bos_token_id = r.optional_integer("bos_token_id");
  c.pad_token_id = r.optional_integer("pad_token_id");
  if (const auto* e = r.find("eos_token_id")) {
    if (e->is_array()) {
      c.eos_is_list = true;
      for (const auto& v : *e) {
        UNIRL_CHECK(v.is_number_integer(), detail::config_where(source, "eos_token_id"), " = ", e->dump(),
                    ": expected an integer or a list of integers");
        c.eos_token_id.push_back(v.get<std::int64_t>());
      }
    } else {
      UNIRL_CHECK(e->is_number_integer(), detail::config_where(source, "eos_token_id"), " = ", e->dump(),
                  ": expected an integer or a list of integers");
      c.eos_token_id.push_back(e->get<std::int64_t>());
    }
  }
  if (c.is_gpt2()) {
    c.hidden_size = r.integer("n_embd");
    c.num_hidden_layers = r.integer("n_layer");
    c.num_attention_heads = r.integer("n_head");
    c.max_position_embeddings = r.integer("n_positions");
    c.intermediate_size = r.integer("n_inner", 4 * c.hidden_size);
    c.norm_eps = r.number("layer_norm_epsilon", 1e-5);
    c.hidden_act = r.string("activation_function", "gelu_new");
    c.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
    r.unsupported_unless("scale_attn_weights", true, "attention scores are always scaled by 1/sqrt(head_dim)");
    r.unsupported_unless("scale_attn_by_inverse_layer_idx", false, "not supported");
    r.unsupported_unless("add_cross_attention", false, "a decoder-only model has no cross-attention");
  } else {
    c.hidden_size = r.integer("hidden_size");
    c.intermediate_size = r.integer("intermediate_size");
    c.num_hidden_layers = r.integer("num_hidden_layers");
    c.num_attention_heads = r.integer("num_attention_heads");
    c.num_key_value_heads = r.integer("num_key_value_heads", 0);
    if (c.arch == architecture::qwen3)
      c.head_dim = r.integer("head_dim");  // Qwen3Config's default (128) is rarely hidden/heads: required
    else
      c.head_dim = r.integer("head_dim", 0);
    c.max_position_embeddings =
        r.integer("max_position_embeddings", c.arch == architecture::llama ? std::int64_t{2048} : std::int64_t{32768});
    c.norm_eps = r.number("rms_norm_eps", 1e-6);
    c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
    if (c.arch != architecture::qwen2) c.attention_bias = r.boolean("attention_bias", false);
    if (c.arch == architecture::llama) c.mlp_bias = r.boolean("mlp_bias", false);
    c.hidden_act = r.string("hidden_act", "silu");
    // RoPE: rope_theta (transformers 4.x) or rope_parameters (5.x); only plain RoPE.
    c.rope_theta = r.number("rope_theta", 10000.0);
    r.unsupported_unless("rope_scaling", nullptr,
                         "only plain RoPE is implemented: linear, dynamic, yarn, longrope and llama3 scaling are not");
    if (const auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
      UNIRL_CHECK(it->is_object(), detail::config_where(source, "rope_parameters"), " = ", it->dump(),
                  ": expected an object");
      const auto type = it->value("rope_type", std::string("default"));
      UNIRL_CHECK(type == "default", detail::config_where(source, "rope_parameters"), ".rope_type = \"", type,
                  "\": unsupported (only plain RoPE, \"default\", is implemented)");
      if (const auto t = it->find("rope_theta"); t != it->end()) {
        UNIRL_CHECK(t->is_number(), detail::config_where(source, "rope_parameters"), ".rope_theta = ", t->dump(),
                    ": expected a number");
        c.rope_theta = t->get<double>();
      }
    }
    r.unsupported_unless("use_sliding_window", false, "sliding-window attention is not supported");
    if (const auto it = j.find("layer_types"); it != j.end() && it->is_array())
      for (const auto& t : *it)
        UNIRL_CHECK(t == "full_attention", detail::config_where(source, "layer_types"), " = ", it->dump(),
                    ": unsupported (sliding-window attention is not supported); expected only \"full_attention\"");
  }
  c.extra = r.unused();
  c.validate(source);
  return c;
}

inline void decoder_config::validate(const std::string& source) const {
  const auto key = [&](std::string_view llama_key, std::string_view gpt2_key) {
    return detail::config_where(source, is_gpt2() ? gpt2_key : llama_key);
  };
  UNIRL_CHECK(vocab_size >= 1, key("vocab_size", "vocab_size"), " = ", vocab_size, ": expected >= 1");
  UNIRL_CHECK(hidden_size >= 1, key("hidden_size", "n_embd"), " = ", hidden_size, ": expected >= 1");
  UNIRL_CHECK(intermediate_size >= 1, key("intermediate_size", "n_inner"), " = ", intermediate_size, ": expected >= 1");
  UNIRL_CHECK(num_hidden_layers >= 1, key("num_hidden_layers", "n_layer"), " = ", num_hidden_layers,
              ": expected >= 1");
  UNIRL_CHECK(num_attention_heads >= 1, key("num_attention_heads", "n_head"), " = ", num_attention_heads,
              ": expected >= 1");
  UNIRL_CHECK(max_position_embeddings >= 1, key("max_position_embeddings", "n_positions"), " = ",
              max_position_embeddings, ": expected >= 1");
  UNIRL_CHECK(norm_eps > 0, key("rms_norm_eps", "layer_norm_epsilon"), " = ", norm_eps, ": expected > 0");
  UNIRL_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16" || torch_dtype == "float16",
              detail::config_where(source, "torch_dtype"), " = \"", torch_dtype,
              "\": expected float32, bfloat16 or float16");
  if (is_gpt2()) {
    UNIRL_CHECK(hidden_size % num_attention_heads == 0, key("", "n_embd"), " = ", hidden_size,
                ": expected a multiple of n_head = ", num_attention_heads);
    UNIRL_CHECK(hidden_act == "gelu_new" || hidden_act == "gelu_pytorch_tanh" || hidden_act == "gelu",
                key("", "activation_function"), " = \"", hidden_act,
                "\": unsupported; expected gelu_new, gelu_pytorch_tanh or gelu");
  } else {
    UNIRL_CHECK(num_key_value_heads >= 0 && num_attention_heads % kv_heads() == 0, key("num_key_value_heads", ""),
                " = ", num_key_value_heads, ": expected >= 1 and dividing num_attention_heads = ", num_attention_heads);
    UNIRL_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, key("hidden_size", ""), " = ", hidden_size,
                ": expected a multiple of num_attention_heads = ", num_attention_heads, " (or an explicit head_dim)");
    UNIRL_CHECK(head_dim >= 0 && head_size() >= 2 && head_size() % 2 == 0, key("head_dim", ""), " = ", head_size(),
                ": expected an even number >= 2 (RoPE rotates pairs)");
    UNIRL_CHECK(rope_theta > 0, key("rope_theta", ""), " = ", rope_theta, ": expected > 0");
    UNIRL_CHECK(hidden_act == "silu" || hidden_act == "swish", key("hidden_act", ""), " = \"", hidden_act,
                "\": unsupported; expected silu");
  }
  for (const auto& [name, id] : {std::pair{"bos_token_id", bos_token_id}, std::pair{"pad_token_id", pad_token_id}})
    UNIRL_CHECK(!id || (*id >= 0 && *id < vocab_size), detail::config_where(source, name), " = ", *id,
                ": expected an id in [0, vocab_size = ", vocab_size, ")");
  for (const auto id : eos_token_id)
    UNIRL_CHECK(id >= 0 && id < vocab_size, detail::config_where(source, "eos_token_id"), " = ", id,
                ": expected ids in [0, vocab_size = ", vocab_size, ")");
}

namespace detail {
// The config.json of a model directory (or the file itself), parsed; `what` names the directory
// kind in the error when it cannot be opened. Returns the JSON and the file's path.
inline std::pair<nlohmann::json, std::string> read_config_json(const std::filesystem::path& file_or_dir,
                                                               const char* what) {
  namespace fs = std::filesystem;
  const auto file = fs::is_directory(file_or_dir) ? file_or_dir / "config.json" : file_or_dir;
  std::ifstream in(file);
  UNIRL_CHECK(in.good(), "hf config ", file.string(), ": cannot be opened (a ", what, " directory holds ",
              "config.json next to its *.safetensors)");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return {nlohmann::json::parse(text.str()), file.string()};
  } catch (const nlohmann::json::parse_error& e) {
    throw error("unirl: hf config " + file.string() + ": not valid JSON: " + e.what());
  }
}
}  // namespace detail

inline decoder_config decoder_config::load(const std::filesystem::path& file_or_dir) {
  const auto [j, file] = detail::read_config_json(file_or_dir, "Hugging Face model");
  return from_json(j, file);
}

inline nlohmann::json decoder_config::to_json() const {
  nlohmann::json j = extra;
  j["architectures"] = nlohmann::json::array({std::string(architecture_name())});
  j["model_type"] = std::string(model_types[static_cast<std::size_t>(arch)]);
  j["vocab_size"] = vocab_size;
  j["torch_dtype"] = torch_dtype;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["bos_token_id"] = bos_token_id ? nlohmann::json(*bos_token_id) : nlohmann::json(nullptr);
  if (pad_token_id) j["pad_token_id"] = *pad_token_id;
  if (eos_is_list) j["eos_token_id"] = eos_token_id;
  else j["eos_token_id"] = eos_token_id.empty() ? nlohmann::json(nullptr) : nlohmann::json(eos_token_id.front());
  if (is_gpt2()) {
    j["n_embd"] = hidden_size;
    j["n_layer"] = num_hidden_layers;
    j["n_head"] = num_attention_heads;
    j["n_positions"] = max_position_embeddings;
    j["n_inner"] = intermediate_size == 4 * hidden_size ? nlohmann::json(nullptr) : nlohmann::json(intermediate_size);
    j["layer_norm_epsilon"] = norm_eps;
    j["activation_function"] = hidden_act;
  } else {
    j["hidden_size"] = hidden_size;
    j["intermediate_size"] = intermediate_size;
    j["num_hidden_layers"] = num_hidden_layers;
    j["num_attention_heads"] = num_attention_heads;
    j["num_key_value_heads"] = kv_heads();
    j["head_dim"] = head_size();
    j["max_position_embeddings"] = max_position_embeddings;
    j["rms_norm_eps"] = norm_eps;
    j["hidden_act"] = hidden_act;
    if (arch != architecture::qwen2) j["attention_bias"] = attention_bias;
    if (arch == architecture::llama) j["mlp_bias"] = mlp_bias;
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) j["rope_parameters"]["rope_theta"] = rope_theta;
    else {
      j["rope_theta"] = rope_theta;
      j["rope_scaling"] = nullptr;
    }
  }
  return j;
}

}  // namespace unirl::models::hf

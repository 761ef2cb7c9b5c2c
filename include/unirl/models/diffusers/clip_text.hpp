#pragma once
/// \file clip_text.hpp
/// The CLIP text side of Stable Diffusion 3: `clip_text_encoder` (transformers'
/// `CLIPTextModelWithProjection`, parameter names `text_model.embeddings.token_embedding.weight`,
/// `text_model.encoder.layers.0.self_attn.q_proj.weight`, ..., `text_projection.weight`) and
/// `clip_tokenizer` (CLIP's BPE from `vocab.json` + `merges.txt`, with the `</w>` end-of-word
/// marker, padded to `model_max_length`).
///
/// ```cpp
/// namespace df = unirl::models::diffusers;
/// auto tok = df::clip_tokenizer::from_dir("sd3/tokenizer");
/// df::clip_text_encoder enc(df::clip_text_config::load("sd3/text_encoder"));
/// auto ids = tok.encode_batch({"a photo of a cat"});             // (1, 77) int64
/// auto [tokens, pooled] = enc->encode(ids);                       // hidden_states[-2], text_embeds
/// ```
/// The encoder shares its layers with the CLIP vision tower (vision/clip.hpp) and runs them
/// with a causal mask; `encode` returns what SD3's pipeline takes: the penultimate hidden state
/// (before `final_layer_norm`) and the projected pooled row (the first EOS token's, or for
/// `eos_token_id` 2 the largest id's, as transformers).
///
/// The tokenizer follows CLIPTokenizerFast's pipeline: NFC, whitespace runs to one space,
/// strip, lower case (ASCII letters only: other letters are kept as written — a difference
/// from Hugging Face for non-ASCII text), split into `<|startoftext|>`, `<|endoftext|>`,
/// the contractions 's 't 're 've 'm 'll 'd, runs of letters, single digits and runs of other
/// non-space characters; each piece byte-mapped (GPT-2's map, tokenizers/bpe.hpp) with `</w>`
/// on its last symbol and merged by rank; then BOS + ids + EOS truncated to the maximum length
/// and padded with `pad_token`.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/diffusers/config.hpp>
#include <unirl/models/vision/clip.hpp>
#include <unirl/tokenizers/bpe.hpp>
#include <unirl/tokenizers/unicode.hpp>

namespace unirl::models::diffusers {

/// CLIP's BPE tokenizer (see the file comment). Copies share nothing mutable; encode is const.
class clip_tokenizer {
 public:
  /// `vocab.json` + `merges.txt` ("#version" line, then "a b" per line); `max_length` tokens per
  /// prompt; `pad_token` (a vocabulary entry).
  static clip_tokenizer from_files(const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt,
                                   std::int64_t max_length = 77, const std::string& pad_token = "<|endoftext|>") {
    clip_tokenizer t;
    const auto vj = detail::read_json(vocab_json);
    for (auto it = vj.begin(); it != vj.end(); ++it) {
      UNIRL_CHECK(it->is_number_integer() && it->get<std::int64_t>() >= 0, "diffusers: ", vocab_json.string(),
                  ": token ", nlohmann::json(it.key()).dump(), " has id ", it->dump(), ": expected an integer >= 0");
      t.vocab_.emplace(it.key(), it->get<std::int64_t>());
    }
    const auto text = tokenizers::detail::read_file(merges_txt);
    std::size_t pos = 0, line_no = 0;
    std::int64_t rank = 0;
    while (pos < text.size()) {
      auto end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      std::string line = text.substr(pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
      const auto sp = line.find(' ');
      UNIRL_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
                  "diffusers: ", merges_txt.string(), ": line ", line_no, " = \"", line, "\": expected \"a b\"");
      t.ranks_.emplace(line, rank++);
    }
    t.bos_ = t.id_of("<|startoftext|>", vocab_json);
    t.eos_ = t.id_of("<|endoftext|>", vocab_json);
    t.pad_ = t.id_of(pad_token, vocab_json);
    UNIRL_CHECK(max_length >= 2, "diffusers: clip_tokenizer: max_length = ", max_length, ": expected >= 2");
    t.max_length_ = max_length;
    return t;
  }

  /// A `tokenizer/` folder: vocab.json, merges.txt and tokenizer_config.json (model_max_length,
  /// pad_token; `tokenizer_class` must be CLIPTokenizer when given).
  static clip_tokenizer from_dir(const std::filesystem::path& dir) {
    std::int64_t max_length = 77;
    std::string pad = "<|endoftext|>";
    std::error_code ec;
    if (std::filesystem::is_regular_file(dir / "tokenizer_config.json", ec)) {
      const auto file = (dir / "tokenizer_config.json").string();
      const auto j = detail::read_json(dir / "tokenizer_config.json");
      const auto token = [&](const char* key) -> std::optional<std::string> {
        if (!j.contains(key) || j[key].is_null()) return std::nullopt;
        const auto& v = j[key];
        if (v.is_string()) return v.get<std::string>();
        UNIRL_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(), "diffusers: ", file,
                    ": key '", key, "' = ", v.dump(), ": expected a string or {\"content\": ...}");
        return v["content"].get<std::string>();
      };
      if (j.contains("tokenizer_class"))
        UNIRL_CHECK(j["tokenizer_class"] == "CLIPTokenizer" || j["tokenizer_class"] == "CLIPTokenizerFast",
                    "diffusers: ", file, ": key 'tokenizer_class' = ", j["tokenizer_class"].dump(),
                    ": expected \"CLIPTokenizer\"");
      if (j.contains("do_lower_case"))
        UNIRL_CHECK(j["do_lower_case"] == true, "diffusers: ", file, ": key 'do_lower_case' = ",
                    j["do_lower_case"].dump(), ": unsupported; CLIP lower-cases (expected true)");
      if (j.contains("model_max_length")) {
        const auto& m = j["model_max_length"];
        UNIRL_CHECK(m.is_number_integer() && m.get<std::int64_t>() >= 2 && m.get<std::int64_t>() <= 1 << 20,
                    "diffusers: ", file, ": key 'model_max_length' = ", m.dump(), ": expected an integer in [2, 2^20]");
        max_length = m.get<std::int64_t>();
      }
      if (const auto p = token("pad_token")) pad = *p;
    }
    return from_files(dir / "vocab.json", dir / "merges.txt", max_length, pad);
  }

  /// Token ids of `text` without BOS / EOS or padding.
  std::vector<std::int64_t> encode(std::string_view text) const {
    std::vector<std::int64_t> out;
    for (const auto& piece : split(normalize(text))) {
      if (piece == "<|startoftext|>") out.push_back(bos_);
      else if (piece == "<|endoftext|>") out.push_back(eos_);
      else for (const auto& sym : merge(piece)) out.push_back(lookup(sym, piece));
    }
    return out;
  }

  /// (B, max_length) int64: BOS, the ids (truncated to max_length - 2), EOS, then pad tokens.
  torch::Tensor encode_batch(const std::vector<std::string>& texts) const {
    auto out = torch::full({static_cast<std::int64_t>(texts.size()), max_length_}, pad_, torch::kInt64);
    auto a = out.accessor<std::int64_t, 2>();
    for (std::size_t i = 0; i < texts.size(); ++i) {
      auto ids = encode(texts[i]);
      if (static_cast<std::int64_t>(ids.size()) > max_length_ - 2) ids.resize(static_cast<std::size_t>(max_length_ - 2));
      const auto r = static_cast<std::int64_t>(i);
      a[r][0] = bos_;
      for (std::size_t k = 0; k < ids.size(); ++k) a[r][static_cast<std::int64_t>(k) + 1] = ids[k];
      a[r][static_cast<std::int64_t>(ids.size()) + 1] = eos_;
    }
    return out;
  }

  std::int64_t max_length() const { return max_length_; }
  std::int64_t bos_id() const { return bos_; }
  std::int64_t eos_id() const { return eos_; }
  std::int64_t pad_id() const { return pad_; }

 private:
  std::int64_t id_of(const std::string& token, const std::filesystem::path& vocab_json) const {
    const auto it = vocab_.find(token);
    UNIRL_CHECK(it != vocab_.end(), "diffusers: ", vocab_json.string(), ": no token ", nlohmann::json(token).dump(),
                " (CLIP's BOS, EOS and the pad token must be in the vocabulary)");
    return it->second;
  }
  std::int64_t lookup(const std::string& sym, const std::string& piece) const {
    const auto it = vocab_.find(sym);
    UNIRL_CHECK(it != vocab_.end(), "diffusers: clip_tokenizer: symbol ", nlohmann::json(sym).dump(), " of ",
                nlohmann::json(piece).dump(), " is not in the vocabulary");
    return it->second;
  }

  static std::string normalize(std::string_view text) {
    namespace uc = tokenizers::unicode;
    const auto s = uc::nfc(text);
    std::string out;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const auto* end = p + s.size();
    bool space = false;
    while (p < end) {
      std::uint32_t cp = 0;
      const auto n = uc::decode_utf8(p, end, cp);
      if (uc::is_space(cp)) {
        space = !out.empty();
      } else {
        if (space) out.push_back(' ');
        space = false;
        if (n == 1 && cp >= 'A' && cp <= 'Z') out.push_back(static_cast<char>(cp - 'A' + 'a'));
        else out.append(reinterpret_cast<const char*>(p), n);
      }
      p += n;
    }
    return out;
  }

  // CLIP's pattern over normalised text (lower case, single spaces).
  static std::vector<std::string> split(const std::string& s) {
    namespace uc = tokenizers::unicode;
    using uc::category;
    std::vector<std::string> out;
    const auto* base = reinterpret_cast<const unsigned char*>(s.data());
    const auto* end = base + s.size();
    const auto cat_at = [&](const unsigned char* q, std::size_t& len) {
      std::uint32_t cp = 0;
      len = uc::decode_utf8(q, end, cp);
      return uc::category_of(cp);
    };
    const auto* p = base;
    while (p < end) {
      const std::string_view rest(reinterpret_cast<const char*>(p), static_cast<std::size_t>(end - p));
      bool matched = false;
      for (std::string_view lit : {"<|startoftext|>", "<|endoftext|>", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}) {
        if (rest.rfind(lit, 0) == 0) {
          out.emplace_back(lit);
          p += lit.size();
          matched = true;
          break;
        }
      }
      if (matched) continue;
      std::size_t len = 0;
      const auto c = cat_at(p, len);
      if (c == category::space) {
        p += len;
        continue;
      }
      const auto* q = p + len;
      if (c == category::letter) {
        while (q < end && cat_at(q, len) == category::letter) q += len;
      } else if (c == category::other) {
        while (q < end) {
          const auto k = cat_at(q, len);
          if (k != category::other) break;
          q += len;
        }
      }
      out.emplace_back(reinterpret_cast<const char*>(p), static_cast<std::size_t>(q - p));
      p = q;
    }
    return out;
  }

  // Byte-mapped symbols of `piece`, `</w>` on the last, merged by rank (lowest first).
  std::vector<std::string> merge(const std::string& piece) const {
    namespace uc = tokenizers::unicode;
    const auto mapped = tokenizers::detail::bytes_to_token(piece);
    std::vector<std::string> syms;
    const auto* p = reinterpret_cast<const unsigned char*>(mapped.data());
    const auto* end = p + mapped.size();
    while (p < end) {
      std::uint32_t cp = 0;
      const auto n = uc::decode_utf8(p, end, cp);
      syms.emplace_back(reinterpret_cast<const char*>(p), n);
      p += n;
    }
    if (syms.empty()) return syms;
    syms.back() += "</w>";
    while (syms.size() > 1) {
      std::int64_t best = std::numeric_limits<std::int64_t>::max();
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < syms.size(); ++i) {
        const auto it = ranks_.find(syms[i] + " " + syms[i + 1]);
        if (it != ranks_.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      }
      if (best == std::numeric_limits<std::int64_t>::max()) break;
      const auto a = syms[at], b = syms[at + 1];
      std::vector<std::string> next;
      for (std::size_t i = 0; i < syms.size();) {
        if (i + 1 < syms.size() && syms[i] == a && syms[i + 1] == b) {
          next.push_back(a + b);
          i += 2;
        } else {
          next.push_back(syms[i++]);
        }
      }
      syms = std::move(next);
    }
    return syms;
  }

  std::unordered_map<std::string, std::int64_t> vocab_, ranks_;
  std::int64_t bos_ = 0, eos_ = 0, pad_ = 0, max_length_ = 77;
};

namespace detail {

inline vision::vision_config as_layer_config(const clip_text_config& c) {
  vision::vision_config v;
  v.hidden_size = c.hidden_size;
  v.intermediate_size = c.intermediate_size;
  v.num_hidden_layers = c.num_hidden_layers;
  v.num_attention_heads = c.num_attention_heads;
  v.hidden_act = c.hidden_act;
  v.layer_norm_eps = c.layer_norm_eps;
  return v;
}

/// `text_model.embeddings`: token_embedding, position_embedding.
class text_embeddings_impl : public torch::nn::Cloneable<text_embeddings_impl> {
 public:
  explicit text_embeddings_impl(const clip_text_config& c) : c_(c) { reset(); }
  void reset() override {
    token_embedding = register_module("token_embedding", torch::nn::Embedding(c_.vocab_size, c_.hidden_size));
    position_embedding =
        register_module("position_embedding", torch::nn::Embedding(c_.max_position_embeddings, c_.hidden_size));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto pos = torch::arange(ids.size(1), ids.options().dtype(torch::kInt64));
    return token_embedding(ids) + position_embedding(pos).unsqueeze(0);
  }
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};

 private:
  clip_text_config c_;
};
TORCH_MODULE_IMPL(text_embeddings, text_embeddings_impl);

/// `text_model`: embeddings, encoder (the vision tower's layers), final_layer_norm.
class text_transformer_impl : public torch::nn::Cloneable<text_transformer_impl> {
 public:
  explicit text_transformer_impl(const clip_text_config& c) : c_(c) { reset(); }
  void reset() override {
    embeddings = register_module("embeddings", text_embeddings(c_));
    encoder = register_module("encoder", vision::detail::vision_encoder(as_layer_config(c_)));
    final_layer_norm = register_module("final_layer_norm", vision::detail::make_layer_norm(c_.hidden_size, c_.layer_norm_eps));
  }
  text_embeddings embeddings{nullptr};
  vision::detail::vision_encoder encoder{nullptr};
  torch::nn::LayerNorm final_layer_norm{nullptr};

 private:
  clip_text_config c_;
};
TORCH_MODULE_IMPL(text_transformer, text_transformer_impl);

}  // namespace detail

/// transformers' CLIPTextModelWithProjection (see the file comment).
class clip_text_encoder_impl : public torch::nn::Cloneable<clip_text_encoder_impl> {
 public:
  explicit clip_text_encoder_impl(clip_text_config c) : c_(std::move(c)) { reset(); }
  void reset() override {
    text_model = register_module("text_model", detail::text_transformer(c_));
    text_projection =
        register_module("text_projection", torch::nn::Linear(torch::nn::LinearOptions(c_.hidden_size, c_.projection_dim).bias(false)));
  }
  const clip_text_config& config() const { return c_; }

  /// What SD3 takes from token ids (B, L), L <= max_position_embeddings: the penultimate hidden
  /// state (B, L, hidden) and the projected pooled embedding (B, projection_dim).
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& ids) {
    UNIRL_CHECK(ids.dim() == 2 && !ids.is_floating_point() && ids.size(1) >= 1 &&
                    ids.size(1) <= c_.max_position_embeddings,
                "diffusers::clip_text_encoder: ids of sizes ", ids.sizes(), " ", ids.dtype(),
                ": expected (B, L) integers with 1 <= L <= max_position_embeddings = ", c_.max_position_embeddings);
    if (ids.numel() > 0) {  // one counted read for both bounds, naming the offending range
      const auto range = to_host(torch::stack({ids.min(), ids.max()}));
      UNIRL_CHECK(range[0] >= 0 && range[1] < c_.vocab_size, "diffusers::clip_text_encoder: token ids in [",
                  static_cast<std::int64_t>(range[0]), ", ", static_cast<std::int64_t>(range[1]),
                  "]: expected [0, vocab_size = ", c_.vocab_size, ")");
    }
    const auto L = ids.size(1);
    const auto tm = text_model.ptr();
    auto x = tm->embeddings->forward(ids.to(torch::kInt64));
    const auto mask = torch::full({L, L}, -std::numeric_limits<float>::infinity(), x.options()).triu(1).view({1, 1, L, L});
    const auto& layers = tm->encoder->layers;
    torch::Tensor penultimate = x;
    for (std::size_t i = 0; i < layers->size(); ++i) {
      penultimate = x;
      x = layers->ptr<vision::detail::vision_layer_impl>(i)->forward(x, mask);
    }
    const auto last = tm->final_layer_norm(x);
    const auto i64 = ids.to(torch::kInt64);
    const auto at = c_.eos_token_id == 2 ? i64.argmax(1) : (i64 == c_.eos_token_id).to(torch::kInt).argmax(1);
    const auto pooled = last.index({torch::arange(ids.size(0), i64.options()), at});
    return {layers->size() >= 1 ? penultimate : x, text_projection(pooled)};
  }

  detail::text_transformer text_model{nullptr};
  torch::nn::Linear text_projection{nullptr};

 private:
  clip_text_config c_;
};
TORCH_MODULE_IMPL(clip_text_encoder, clip_text_encoder_impl);

}  // namespace unirl::models::diffusers

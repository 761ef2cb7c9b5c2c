#pragma once
/// \file jsonl.hpp
/// Prompt / answer records from a JSONL file (one JSON object per line), with the field names
/// chosen in the recipe, a seeded shuffle per epoch, and a position that checkpoints with the
/// trainer (`unirl::Checkpointable`), so a resumed run draws the very records the uninterrupted
/// run would have drawn.
///
/// ```cpp
/// unirl::data::jsonl_dataset ds({.path = "train.jsonl", .prompt_key = "question", .answer_key = "answer"});
/// auto records = ds.next(16);                  // 16 records, reshuffled at each epoch
/// t.save("run/ckpt.pt", ds);                   // later: t.load("run/ckpt.pt", ds)
/// ```
///
/// A record's prompt is a string, or a list of chat messages (`[{"role": ..., "content": ...}]`,
/// kept as `messages` for a chat template). The answer is a string or a number (written as text).
/// Keys may be dotted to reach nested objects (`"meta.answer"`). Blank lines are skipped. A bad
/// record is an error naming the file, the line and the field.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/checkpoint.hpp>

namespace unirl::data {

/// Where the records come from and how they are drawn.
struct jsonl_options {
  std::string path{};                 // the JSONL file
  std::string prompt_key = "prompt";  // string, or a list of {"role", "content"} messages
  std::string answer_key = "answer";  // string or number; empty: records carry no answer
  bool shuffle = true;                // a fresh permutation (seed, epoch) at every epoch
  std::int64_t seed = 0;
  std::int64_t max_records = 0;       // > 0: keep only the first N records of the file

  void validate(const std::string& p) const {
    options::require(!prompt_key.empty(), p + "prompt_key", prompt_key, "a field name");
    options::require(max_records >= 0, p + "max_records", max_records, ">= 0");
  }
};

}  // namespace unirl::data

BOOST_HANA_ADAPT_STRUCT(unirl::data::jsonl_options, path, prompt_key, answer_key, shuffle, seed, max_records);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::data::jsonl_options>{
    unirl::options::field_doc{"path", "the JSONL file, one record per line"},
    unirl::options::field_doc{"prompt_key", "field of the prompt (dotted for nested): a string, or a list of {\"role\", \"content\"} messages"},
    unirl::options::field_doc{"answer_key", "field of the ground-truth answer (string or number); empty = no answers"},
    unirl::options::field_doc{"shuffle", "a fresh permutation (seed, epoch) at every epoch"},
    unirl::options::field_doc{"seed", "seed of the shuffling"},
    unirl::options::field_doc{"max_records", "> 0: only the first N records of the file"}};

namespace unirl::data {

/// One chat message of a prompt.
struct message {
  std::string role, content;
};

/// One record of the file.
struct record {
  std::string prompt{};             // the prompt text (empty when given as messages)
  std::vector<message> messages{};  // the prompt as chat messages (empty when given as text)
  std::string answer{};             // the ground truth ("" when the dataset has no answer field)
  std::int64_t line = 0;            // 1-based line in the file, for messages
};

namespace detail {
// The value at a dotted key, or nullptr.
inline const nlohmann::json* find_path(const nlohmann::json& j, const std::string& key) {
  const nlohmann::json* cur = &j;
  std::size_t start = 0;
  for (;;) {
    const auto dot = key.find('.', start);
    const auto part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!cur->is_object()) return nullptr;
    const auto it = cur->find(part);
    if (it == cur->end()) return nullptr;
    cur = &*it;
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

inline std::string kind_of(const nlohmann::json& j) { return j.type_name(); }
}  // namespace detail

/// Reads a JSONL file of records (see the file comment). Throws `unirl::error` naming the file,
/// the line and the field for a line that is not a JSON object, a missing field or a field of
/// the wrong type; an empty file is an error too.
inline std::vector<record> read_jsonl(const jsonl_options& o) {
  std::ifstream in(o.path, std::ios::binary);
  UNIRL_CHECK(static_cast<bool>(in), "jsonl: cannot open '", o.path, "'");
  std::vector<record> out;
  std::string text;
  std::int64_t line = 0;
  const auto where = [&] { return o.path + ":" + std::to_string(line); };
  while (std::getline(in, text)) {
    ++line;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw error("unirl: jsonl: " + where() + ": not valid JSON: " + e.what());
    }
    UNIRL_CHECK(j.is_object(), "jsonl: ", where(), ": a record must be a JSON object, got ", detail::kind_of(j));
    record r;
    r.line = line;
    const auto* p = detail::find_path(j, o.prompt_key);
    UNIRL_CHECK(p != nullptr, "jsonl: ", where(), ": field '", o.prompt_key, "' (prompt_key) is missing");
    if (p->is_string()) {
      r.prompt = p->get<std::string>();
    } else if (p->is_array()) {
      UNIRL_CHECK(!p->empty(), "jsonl: ", where(), ": field '", o.prompt_key, "' is an empty list of messages");
      for (std::size_t i = 0; i < p->size(); ++i) {
        const auto& m = (*p)[i];
        const auto field = o.prompt_key + "[" + std::to_string(i) + "]";
        UNIRL_CHECK(m.is_object() && m.contains("role") && m.contains("content") && m["role"].is_string() &&
                        m["content"].is_string(),
                    "jsonl: ", where(), ": field '", field, "' must be {\"role\": string, \"content\": string}");
        r.messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      }
    } else {
      UNIRL_CHECK(false, "jsonl: ", where(), ": field '", o.prompt_key, "' must be a string or a list of messages, got ",
                  detail::kind_of(*p));
    }
    if (!o.answer_key.empty()) {
      const auto* a = detail::find_path(j, o.answer_key);
      UNIRL_CHECK(a != nullptr, "jsonl: ", where(), ": field '", o.answer_key, "' (answer_key) is missing");
      if (a->is_string()) r.answer = a->get<std::string>();
      else if (a->is_number_integer()) r.answer = std::to_string(a->get<std::int64_t>());
      else if (a->is_number()) r.answer = a->dump();
      else
        UNIRL_CHECK(false, "jsonl: ", where(), ": field '", o.answer_key, "' must be a string or a number, got ",
                    detail::kind_of(*a));
    }
    out.push_back(std::move(r));
    if (o.max_records > 0 && static_cast<std::int64_t>(out.size()) >= o.max_records) break;
  }
  UNIRL_CHECK(!out.empty(), "jsonl: '", o.path, "' holds no records");
  return out;
}

/// Records drawn in epochs: every record once per epoch, in a permutation that depends only on
/// (seed, epoch) when `shuffle`, in file order otherwise. `Checkpointable`: the position (epoch,
/// cursor) and a fingerprint of the file are saved, and loading checks the fingerprint.
class jsonl_dataset {
 public:
  explicit jsonl_dataset(jsonl_options o) : o_(std::move(o)) {
    options::validate(o_);
    records_ = read_jsonl(o_);
    fingerprint_ = compute_fingerprint();
    reorder();
  }

  std::int64_t size() const { return static_cast<std::int64_t>(records_.size()); }
  const record& operator[](std::int64_t i) const { return records_.at(static_cast<std::size_t>(i)); }
  const std::vector<record>& records() const { return records_; }
  const jsonl_options& options() const { return o_; }
  std::int64_t epoch() const { return epoch_; }
  std::int64_t cursor() const { return cursor_; }

  /// The next `n` records, crossing into the next epoch (and its permutation) when needed.
  std::vector<record> next(std::int64_t n) {
    UNIRL_CHECK(n >= 1, "jsonl_dataset::next: n = ", n, ": expected >= 1");
    std::vector<record> out;
    out.reserve(static_cast<std::size_t>(n));
    while (static_cast<std::int64_t>(out.size()) < n) {
      if (cursor_ == size()) {
        ++epoch_;
        cursor_ = 0;
        reorder();
      }
      out.push_back(records_[static_cast<std::size_t>(order_[static_cast<std::size_t>(cursor_++)])]);
    }
    return out;
  }

  void save(torch::serialize::OutputArchive& a) const {
    train::write_scalar(a, "jsonl.format", std::int64_t{1});
    train::write_scalar(a, "jsonl.epoch", epoch_);
    train::write_scalar(a, "jsonl.cursor", cursor_);
    train::write_scalar(a, "jsonl.seed", o_.seed);
    train::write_scalar(a, "jsonl.fingerprint", fingerprint_);
  }

  /// Restores the position; a checkpoint of another file (other records) or another seed is a
  /// `checkpoint_error`, and this dataset is left unchanged.
  void load(torch::serialize::InputArchive& a) {
    const auto format = train::read_scalar<std::int64_t>(a, "jsonl.format");
    if (format != 1) throw checkpoint_error("jsonl_dataset::load: format " + std::to_string(format) + "; expected 1");
    const auto fp = train::read_scalar<std::string>(a, "jsonl.fingerprint");
    if (fp != fingerprint_)
      throw checkpoint_error("jsonl_dataset::load: the checkpoint was taken on other records (" + fp + ") than '" +
                             o_.path + "' holds now (" + fingerprint_ + ")");
    const auto seed = train::read_scalar<std::int64_t>(a, "jsonl.seed");
    if (seed != o_.seed)
      throw checkpoint_error("jsonl_dataset::load: the checkpoint's seed is " + std::to_string(seed) +
                             ", this dataset's " + std::to_string(o_.seed));
    const auto epoch = train::read_scalar<std::int64_t>(a, "jsonl.epoch");
    const auto cursor = train::read_scalar<std::int64_t>(a, "jsonl.cursor");
    if (epoch < 0 || cursor < 0 || cursor > size())
      throw checkpoint_error("jsonl_dataset::load: position (epoch " + std::to_string(epoch) + ", cursor " +
                             std::to_string(cursor) + ") is outside the " + std::to_string(size()) + " records");
    epoch_ = epoch;
    cursor_ = cursor;
    reorder();
  }

 private:
  void reorder() {
    order_.resize(records_.size());
    std::iota(order_.begin(), order_.end(), std::int64_t{0});
    if (!o_.shuffle) return;
    std::mt19937_64 rng(static_cast<std::uint64_t>(o_.seed) * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch_));
    // Fisher-Yates with our own index draw: std::shuffle's use of the engine is not specified,
    // so the order would differ between standard libraries.
    for (std::size_t i = order_.size(); i > 1; --i) {
      const auto j = static_cast<std::size_t>(rng() % i);
      std::swap(order_[i - 1], order_[j]);
    }
  }

  // Size and a 64-bit FNV-1a over every prompt and answer: enough to tell another file apart.
  std::string compute_fingerprint() const {
    std::uint64_t h = 1469598103934665603ULL;
    const auto mix = [&](const std::string& s) {
      for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
      h = (h ^ 0xFFu) * 1099511628211ULL;
    };
    for (const auto& r : records_) {
      mix(r.prompt);
      for (const auto& m : r.messages) mix(m.role + "\x1f" + m.content);
      mix(r.answer);
    }
    std::ostringstream os;
    os << records_.size() << ":" << std::hex << h;
    return os.str();
  }

  jsonl_options o_;
  std::vector<record> records_;
  std::vector<std::int64_t> order_;
  std::int64_t epoch_ = 0, cursor_ = 0;
  std::string fingerprint_;
};

static_assert(Checkpointable<jsonl_dataset>);

}  // namespace unirl::data


#pragma once
/// \file rules.hpp
/// Rule rewards over text: exact answer, regex format, the soft overlong penalty (DAPO), IoU of
/// boxes written in the text, and sentence BLEU-4. Each is a scorer for any batch with the fields
/// it reads (`completions`, and `references` where it compares), returning (B,) float32.
///
/// ```cpp
/// unirl::rewards::exact_answer exact{{.extract = R"(=\s*(-?\d+))", .numeric = true}};
/// unirl::rewards::regex_format fmt{{.pattern = R"(.*=\s*-?\d+)"}};
/// unirl::rewards::overlong_penalty len{{.max_length = 64, .cache_length = 16}};
/// torch::Tensor r = exact(batch) + 0.1 * fmt(batch) + len(batch);
/// ```
/// Patterns are RE2 regular expressions (https://github.com/google/re2/wiki/Syntax): matching
/// takes time linear in the text and bounded stack, whatever the pattern and the completion —
/// completions are untrusted text (a model can write 100 000 characters). RE2 has no
/// backreferences (`\1`) and no lookaround (`(?=`, `(?!`, `(?<=`, `(?<!`); a pattern using them is
/// refused with a `config_error` naming it. Text is UTF-8: `.` and `[^x]` match one character
/// (never an invalid byte, nor `\n` unless `(?s)`); `\d`, `\s`, `\w` are ASCII classes.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <re2/re2.h>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/eval/bleu.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// How the overlong penalty measures a completion.
enum class length_unit { characters, words, tokens };
/// How boxes are written: corners (x1, y1, x2, y2) or corner and size (x, y, w, h).
enum class box_format { xyxy, xywh };
}  // namespace unirl::rewards

template <>
inline constexpr std::array unirl::enum_names<unirl::rewards::length_unit>{
    std::string_view{"characters"}, std::string_view{"words"}, std::string_view{"tokens"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::rewards::box_format>{std::string_view{"xyxy"},
                                                                          std::string_view{"xywh"}};

namespace unirl::rewards {

using unirl::HasCompletionLengths;

namespace detail {
inline std::string trim(std::string_view s) {
  auto b = s.begin(), e = s.end();
  while (b != e && std::isspace(static_cast<unsigned char>(*b))) ++b;
  while (e != b && std::isspace(static_cast<unsigned char>(*(e - 1)))) --e;
  return std::string(b, e);
}

/// A compiled RE2 pattern; a pattern RE2 cannot compile is a `config_error` naming `key`, the
/// pattern and RE2's reason (with a hint when it uses Perl features RE2 lacks).
inline std::shared_ptr<const re2::RE2> compile(const std::string& pattern, const std::string& key) {
  re2::RE2::Options o;
  o.set_log_errors(false);
  auto re = std::make_shared<const re2::RE2>(pattern, o);
  if (!re->ok()) {
    std::string why = "'" + pattern + "' is not a valid RE2 regular expression: " + re->error();
    if (re->error_code() == re2::RE2::ErrorBadEscape || re->error_code() == re2::RE2::ErrorBadPerlOp)
      why += " (RE2 has no backreferences such as \\1 and no lookaround such as (?= (?! (?<= (?<!)";
    throw config_error(key, why);
  }
  return re;
}

/// The numbers written in `s`, in order; a number too large for a double is +-infinity.
inline std::vector<double> numbers_in(const std::string& s) {
  static const re2::RE2 number(R"(([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))");
  std::vector<double> out;
  re2::StringPiece rest(s.data(), s.size());
  re2::StringPiece found;
  while (re2::RE2::FindAndConsume(&rest, number, &found)) {
    const std::string text(found.data(), found.size());
    out.push_back(std::strtod(text.c_str(), nullptr));  // HUGE_VAL on overflow, never throws
  }
  return out;
}

inline std::optional<double> parse_number(const std::string& s) {
  try {
    std::size_t pos = 0;
    const double v = std::stod(s, &pos);
    if (pos != s.size()) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
/// Options of `exact_answer`.
struct exact_answer_options {
  std::string extract = "";       // RE2 regex; the answer is its capture group 1 (or whole match) at the LAST match; empty = whole completion
  bool trim = true;               // ignore surrounding whitespace
  bool case_sensitive = true;
  bool numeric = false;           // compare as numbers (|a - b| <= tolerance); a non-number is wrong
  double tolerance = 1e-6;
  double correct = 1.0, wrong = 0.0;

  void validate(const std::string& prefix) const {
    options::require(tolerance >= 0, prefix + "tolerance", tolerance, ">= 0");
    if (!extract.empty()) (void)detail::compile(extract, prefix + "extract");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::exact_answer_options, extract, trim, case_sensitive, numeric, tolerance,
                        correct, wrong);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::rewards::exact_answer_options>{
    unirl::options::field_doc{"extract", "RE2 regex; the answer is its group 1 (or whole match) at the last match; empty = the whole completion"},
    unirl::options::field_doc{"trim", "ignore surrounding whitespace"},
    unirl::options::field_doc{"case_sensitive", "compare case-sensitively"},
    unirl::options::field_doc{"numeric", "compare as numbers within tolerance (a non-number is wrong)"},
    unirl::options::field_doc{"tolerance", "numeric tolerance"},
    unirl::options::field_doc{"correct", "reward of a right answer"},
    unirl::options::field_doc{"wrong", "reward of a wrong answer"}};
namespace unirl::rewards {

/// `correct` when the completion's answer equals the sample's reference, else `wrong`.
struct exact_answer {
  using options = exact_answer_options;
  static constexpr std::string_view name = "exact_answer";

  exact_answer() : exact_answer(options{}) {}
  explicit exact_answer(options o) : opts_(std::move(o)) {
    unirl::options::validate(opts_);
    if (!opts_.extract.empty()) re_ = detail::compile(opts_.extract, "extract");
  }

  /// The answer a completion gives (after extraction and trimming); nullopt when none is found.
  std::optional<std::string> answer(const std::string& completion) const {
    std::string a = completion;
    if (re_) {
      // Successive non-overlapping matches, left to right; keep the last.
      const re2::StringPiece text(completion.data(), completion.size());
      const int n = re_->NumberOfCapturingGroups() >= 1 ? 2 : 1;
      re2::StringPiece m[2];
      std::optional<std::string> last;
      std::size_t pos = 0;
      while (pos <= text.size() && re_->Match(text, pos, text.size(), re2::RE2::UNANCHORED, m, n)) {
        last = n == 2 && m[1].data() != nullptr ? std::string(m[1].data(), m[1].size()) : std::string(m[0].data(), m[0].size());
        pos = static_cast<std::size_t>(m[0].data() - text.data()) + m[0].size();
        if (m[0].empty()) {  // an empty match: step over one (UTF-8) character
          if (pos >= text.size()) break;
          ++pos;
          while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
        }
      }
      if (!last) return std::nullopt;
      a = std::move(*last);
    }
    return normalise(a);
  }

  template <class B>
    requires HasCompletions<B> && HasReferences<B>
  torch::Tensor operator()(const B& b) const {
    const auto& completions = completions_of(b, "exact_answer");
    std::vector<float> r;
    r.reserve(completions.size());
    for (std::size_t i = 0; i < completions.size(); ++i) {
      const auto got = answer(completions[i]);
      const auto want = normalise(reference_at(b, i, "exact_answer"));
      bool ok = false;
      if (got && opts_.numeric) {
        const auto x = detail::parse_number(*got), y = detail::parse_number(want);
        ok = x && y && std::abs(*x - *y) <= opts_.tolerance;
      } else if (got) {
        ok = *got == want;
      }
      r.push_back(static_cast<float>(ok ? opts_.correct : opts_.wrong));
    }
    return to_scores(r);
  }

 private:
  std::string normalise(std::string s) const {
    if (opts_.trim) s = detail::trim(s);
    if (!opts_.case_sensitive)
      std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
  }
  options opts_;
  std::shared_ptr<const re2::RE2> re_;
};

// ---------------------------------------------------------------------------------------------
/// Options of `regex_format`.
struct regex_format_options {
  std::string pattern = ".*";   // RE2 regular expression (see the file comment)
  bool full_match = true;       // the whole completion must match (else: a match anywhere)
  double matched = 1.0, unmatched = 0.0;

  void validate(const std::string& prefix) const { (void)detail::compile(pattern, prefix + "pattern"); }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::regex_format_options, pattern, full_match, matched, unmatched);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::rewards::regex_format_options>{
    unirl::options::field_doc{"pattern", "RE2 regular expression the completion must match"},
    unirl::options::field_doc{"full_match", "the whole completion must match (else a match anywhere)"},
    unirl::options::field_doc{"matched", "reward of a matching completion"},
    unirl::options::field_doc{"unmatched", "reward of any other"}};
namespace unirl::rewards {

/// `matched` when the completion has the required format, else `unmatched`.
struct regex_format {
  using options = regex_format_options;
  static constexpr std::string_view name = "format";

  regex_format() : regex_format(options{}) {}
  explicit regex_format(options o) : opts_(std::move(o)), re_(detail::compile(opts_.pattern, "pattern")) {}

  template <HasCompletions B>
  torch::Tensor operator()(const B& b) const {
    std::vector<float> r;
    r.reserve(b.completions.size());
    for (const auto& c : completions_of(b, "regex_format")) {
      const re2::StringPiece text(c.data(), c.size());
      const bool ok = opts_.full_match ? re2::RE2::FullMatch(text, *re_) : re2::RE2::PartialMatch(text, *re_);
      r.push_back(static_cast<float>(ok ? opts_.matched : opts_.unmatched));
    }
    return to_scores(r);
  }

 private:
  options opts_;
  std::shared_ptr<const re2::RE2> re_;
};

// ---------------------------------------------------------------------------------------------
/// Options of `overlong_penalty`.
struct overlong_options {
  std::int64_t max_length = 512;      // L_max
  std::int64_t cache_length = 128;    // L_cache: the soft band (L_max - L_cache, L_max]
  length_unit unit = length_unit::characters;  // tokens needs `batch.completion_lengths`

  void validate(const std::string& prefix) const {
    options::require(max_length >= 1, prefix + "max_length", max_length, ">= 1");
    options::require(cache_length >= 0 && cache_length <= max_length, prefix + "cache_length", cache_length,
                     "in [0, max_length]");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::overlong_options, max_length, cache_length, unit);
namespace unirl::rewards {

/// DAPO's soft overlong penalty (arXiv 2503.14476, docs/algorithms/grpo.md), for a length L:
/// 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max;
/// -1 beyond L_max. Add it to the task reward with weight 1.
struct overlong_penalty {
  using options = overlong_options;
  static constexpr std::string_view name = "overlong";

  overlong_penalty() : overlong_penalty(options{}) {}
  explicit overlong_penalty(options o) : opts_(std::move(o)) { unirl::options::validate(opts_); }

  /// The penalty for one length.
  double penalty(std::int64_t length) const {
    const auto soft = opts_.max_length - opts_.cache_length;
    if (length <= soft) return 0.0;
    if (length <= opts_.max_length) return static_cast<double>(soft - length) / static_cast<double>(opts_.cache_length);
    return -1.0;
  }

  template <class B>
    requires HasCompletions<B> || HasCompletionLengths<B>
  torch::Tensor operator()(const B& b) const {
    const auto lengths = lengths_of(b);
    std::vector<float> r;
    r.reserve(lengths.size());
    for (auto l : lengths) r.push_back(static_cast<float>(penalty(l)));
    return to_scores(r);
  }

 private:
  template <class B>
  std::vector<std::int64_t> lengths_of(const B& b) const {
    std::vector<std::int64_t> out;
    if (opts_.unit == length_unit::tokens) {
      if constexpr (requires { { b.lengths() } -> std::convertible_to<torch::Tensor>; }) {
        auto t = b.lengths().to(torch::kCPU).to(torch::kInt64).contiguous();
        out.assign(t.template data_ptr<std::int64_t>(), t.template data_ptr<std::int64_t>() + t.numel());
        return out;
      } else if constexpr (HasCompletionLengths<B>) {
        if constexpr (requires { b.completion_lengths.dim(); }) {
          auto t = b.completion_lengths.to(torch::kCPU).to(torch::kInt64).contiguous();
          out.assign(t.template data_ptr<std::int64_t>(), t.template data_ptr<std::int64_t>() + t.numel());
        } else {
          for (auto l : b.completion_lengths) out.push_back(static_cast<std::int64_t>(l));
        }
        return out;
      } else {
        throw config_error("unit", "is 'tokens' but the batch has no completion_lengths; expected 'characters' or 'words'");
      }
    }
    if constexpr (HasCompletions<B>) {
      for (const auto& c : completions_of(b, "overlong_penalty")) {
        if (opts_.unit == length_unit::characters) {
          out.push_back(static_cast<std::int64_t>(c.size()));
        } else {
          std::int64_t words = 0;
          bool in = false;
          for (unsigned char ch : c) {
            const bool space = std::isspace(ch);
            if (!space && !in) ++words;
            in = !space;
          }
          out.push_back(words);
        }
      }
      return out;
    } else {
      throw config_error("unit", "is '" + std::string(enum_to_string(opts_.unit)) +
                                     "' but the batch has no completions text; expected 'tokens'");
    }
  }
  options opts_;
};

// ---------------------------------------------------------------------------------------------
/// Intersection over union of boxes (x1, y1, x2, y2), row by row: `a`, `b` (N, 4) -> (N,).
/// Degenerate boxes (x2 < x1 or y2 < y1) have zero area; two empty boxes have IoU 0.
inline torch::Tensor box_iou(const torch::Tensor& a, const torch::Tensor& b) {
  UNIRL_CHECK(a.dim() == 2 && a.size(1) == 4 && a.sizes() == b.sizes(), "box_iou: boxes of shapes ", a.sizes(), " and ",
              b.sizes(), "; expected two (N, 4) tensors");
  auto A = a.to(torch::kFloat64), B = b.to(torch::kFloat64);
  auto area = [](const torch::Tensor& t) {
    return (t.select(1, 2) - t.select(1, 0)).clamp_min(0) * (t.select(1, 3) - t.select(1, 1)).clamp_min(0);
  };
  auto w = (torch::minimum(A.select(1, 2), B.select(1, 2)) - torch::maximum(A.select(1, 0), B.select(1, 0))).clamp_min(0);
  auto h = (torch::minimum(A.select(1, 3), B.select(1, 3)) - torch::maximum(A.select(1, 1), B.select(1, 1))).clamp_min(0);
  auto inter = w * h;
  auto uni = area(A) + area(B) - inter;
  return torch::where(uni > 0, inter / uni.clamp_min(1e-300), torch::zeros_like(uni));
}

/// Options of `iou_reward`.
struct iou_options {
  box_format format = box_format::xyxy;
  double threshold = 0.0;   // > 0: reward 1 when IoU >= threshold, else 0; 0: the IoU itself
  double invalid = 0.0;     // reward of a completion without four (finite) numbers

  void validate(const std::string& prefix) const {
    options::require(threshold >= 0 && threshold <= 1, prefix + "threshold", threshold, "in [0, 1]");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::iou_options, format, threshold, invalid);
namespace unirl::rewards {

/// IoU between the first box written in the completion and the box in the reference (the first
/// four numbers of each, e.g. "[12, 30, 40, 64]") — visual grounding rewards.
struct iou_reward {
  using options = iou_options;
  static constexpr std::string_view name = "iou";

  iou_reward() : iou_reward(options{}) {}
  explicit iou_reward(options o) : opts_(std::move(o)) { unirl::options::validate(opts_); }

  template <class B>
    requires HasCompletions<B> && HasReferences<B>
  torch::Tensor operator()(const B& b) const {
    const auto n = static_cast<std::int64_t>(completions_of(b, "iou_reward").size());
    auto pred = torch::zeros({n, 4}, torch::kFloat64), ref = torch::zeros({n, 4}, torch::kFloat64);
    std::vector<bool> valid(n);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto r = detail::numbers_in(reference_at(b, static_cast<std::size_t>(i), "iou_reward"));
      UNIRL_CHECK(r.size() >= 4, "iou_reward: reference ", i, " '", b.references[i], "' has ", r.size(),
                  " numbers; expected a box of four");
      UNIRL_CHECK(std::all_of(r.begin(), r.begin() + 4, [](double v) { return std::isfinite(v); }), "iou_reward: reference ",
                  i, " '", b.references[i], "' has a coordinate beyond the range of a double; expected a finite box");
      const auto p = detail::numbers_in(b.completions[i]);
      // A box with a coordinate too large for a double is no box: the completion gets `invalid`.
      valid[i] = p.size() >= 4 && std::all_of(p.begin(), p.begin() + 4, [](double v) { return std::isfinite(v); });
      for (int k = 0; k < 4; ++k) {
        ref[i][k] = r[k];
        if (valid[i]) pred[i][k] = p[k];
      }
    }
    if (opts_.format == box_format::xywh) {
      auto to_xyxy = [](const torch::Tensor& t) {
        return torch::stack({t.select(1, 0), t.select(1, 1), t.select(1, 0) + t.select(1, 2), t.select(1, 1) + t.select(1, 3)}, 1);
      };
      pred = to_xyxy(pred);
      ref = to_xyxy(ref);
    }
    auto iou = n > 0 ? box_iou(pred, ref) : torch::zeros({0}, torch::kFloat64);
    if (opts_.threshold > 0) iou = (iou >= opts_.threshold).to(torch::kFloat64);
    std::vector<float> r(n);
    for (std::int64_t i = 0; i < n; ++i) r[i] = static_cast<float>(valid[i] ? iou[i].item<double>() : opts_.invalid);
    return to_scores(r);
  }

 private:
  options opts_;
};

// ---------------------------------------------------------------------------------------------
/// Options of `bleu_reward`: BLEU's own options (sentence level, smoothed by default) and how a
/// reference string holds several references.
struct bleu_reward_options {
  eval::bleu_options bleu{.smoothing = eval::bleu_smoothing::exponential};
  std::string reference_separator = "";   // non-empty: split each reference into several on it
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::bleu_reward_options, bleu, reference_separator);
namespace unirl::rewards {

/// Sentence BLEU-4 of each completion against its reference(s), in [0, 1].
struct bleu_reward {
  using options = bleu_reward_options;
  static constexpr std::string_view name = "bleu";

  bleu_reward() : bleu_reward(options{}) {}
  explicit bleu_reward(options o) : opts_(std::move(o)) { unirl::options::validate(opts_); }

  template <class B>
    requires HasCompletions<B> && HasReferences<B>
  torch::Tensor operator()(const B& b) const {
    const auto& completions = completions_of(b, "bleu_reward");
    std::vector<float> r;
    r.reserve(completions.size());
    for (std::size_t i = 0; i < completions.size(); ++i) {
      const auto& ref = reference_at(b, i, "bleu_reward");
      std::vector<std::string> refs;
      if (opts_.reference_separator.empty()) {
        refs.push_back(ref);
      } else {
        std::size_t start = 0, pos;
        while ((pos = ref.find(opts_.reference_separator, start)) != std::string::npos) {
          refs.push_back(ref.substr(start, pos - start));
          start = pos + opts_.reference_separator.size();
        }
        refs.push_back(ref.substr(start));
      }
      r.push_back(static_cast<float>(eval::sentence_bleu(b.completions[i], refs, opts_.bleu)));
    }
    return to_scores(r);
  }

 private:
  options opts_;
};

}  // namespace unirl::rewards

#pragma once
/// \file bleu.hpp
/// BLEU (Papineni et al., 2002): the geometric mean of clipped n-gram precisions (n = 1..4 by
/// default, uniform weights) times the brevity penalty `BP = exp(1 - r/c)` when the candidate
/// length `c` is at most the reference length `r` (the closest reference length, ties to the
/// shorter, summed over the corpus), else 1. Scores are in [0, 1].
///
/// Smoothing for sentence-level use (Chen & Cherry, 2014; as NLTK numbers them):
/// `epsilon` (method 1: a zero match count becomes `epsilon`), `add_one` (method 2: +1 to the
/// numerator and denominator of every order n >= 2), `exponential` (method 3, NIST / sacreBLEU's
/// "exp": the k-th order with zero matches gets precision 1 / (2^k * count)).
///
/// ```cpp
/// double b = unirl::eval::sentence_bleu("the cat sat on the mat", {"the cat sat on a mat"},
///                                       {.smoothing = unirl::eval::bleu_smoothing::exponential});
/// auto corpus = unirl::eval::corpus_bleu(hypotheses, references);   // corpus.score, .precisions, ...
/// ```
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <boost/hana.hpp>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::eval {

/// Smoothing of zero n-gram precisions.
enum class bleu_smoothing { none, epsilon, add_one, exponential };
/// How text is split into tokens.
enum class bleu_tokenize { whitespace, characters };
}  // namespace unirl::eval

template <>
inline constexpr std::array unirl::enum_names<unirl::eval::bleu_smoothing>{
    std::string_view{"none"}, std::string_view{"epsilon"}, std::string_view{"add_one"}, std::string_view{"exponential"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::eval::bleu_tokenize>{std::string_view{"whitespace"},
                                                                          std::string_view{"characters"}};

namespace unirl::eval {

/// Options of BLEU.
struct bleu_options {
  std::int64_t max_order = 4;                          // BLEU-4
  bleu_smoothing smoothing = bleu_smoothing::none;     // corpus BLEU is usually unsmoothed
  double epsilon = 0.1;                                // for bleu_smoothing::epsilon
  bleu_tokenize tokenize = bleu_tokenize::whitespace;  // for the text overloads
  bool lowercase = false;                              // for the text overloads

  void validate(const std::string& prefix) const {
    options::require(max_order >= 1, prefix + "max_order", max_order, ">= 1");
    options::require(epsilon > 0, prefix + "epsilon", epsilon, "> 0");
  }
};

}  // namespace unirl::eval

BOOST_HANA_ADAPT_STRUCT(unirl::eval::bleu_options, max_order, smoothing, epsilon, tokenize, lowercase);

namespace unirl::eval {

/// A BLEU score with its parts.
struct bleu_result {
  double score = 0;                  // in [0, 1]
  std::vector<double> precisions;    // p_n after smoothing, n = 1..max_order
  double brevity_penalty = 0;
  std::int64_t hypothesis_length = 0, reference_length = 0;
};

using tokens = std::vector<std::string>;

/// Splits text into BLEU tokens.
inline tokens tokenize(const std::string& text, const bleu_options& o = {}) {
  std::string t = text;
  if (o.lowercase)
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  tokens out;
  if (o.tokenize == bleu_tokenize::characters) {
    for (char c : t)
      if (!std::isspace(static_cast<unsigned char>(c))) out.emplace_back(1, c);
  } else {
    std::istringstream is(t);
    std::string w;
    while (is >> w) out.push_back(w);
  }
  return out;
}

namespace detail {
inline std::map<tokens, std::int64_t> ngram_counts(const tokens& s, std::int64_t n) {
  std::map<tokens, std::int64_t> c;
  const auto len = static_cast<std::int64_t>(s.size());
  for (std::int64_t i = 0; i + n <= len; ++i) ++c[tokens(s.begin() + i, s.begin() + i + n)];
  return c;
}
}  // namespace detail

/// Corpus BLEU over token sequences: `references[i]` holds one or more references of hypothesis i.
inline bleu_result corpus_bleu(const std::vector<tokens>& hypotheses, const std::vector<std::vector<tokens>>& references,
                               const bleu_options& o = {}) {
  options::validate(o);
  UNIRL_CHECK(hypotheses.size() == references.size(), "corpus_bleu: ", hypotheses.size(), " hypotheses but ",
              references.size(), " reference lists; expected one list per hypothesis");
  const auto N = o.max_order;
  std::vector<std::int64_t> matches(N, 0), totals(N, 0);
  bleu_result r;
  for (std::size_t i = 0; i < hypotheses.size(); ++i) {
    const auto& h = hypotheses[i];
    const auto& refs = references[i];
    UNIRL_CHECK(!refs.empty(), "corpus_bleu: hypothesis ", i, " has no reference; expected at least one");
    const auto c = static_cast<std::int64_t>(h.size());
    r.hypothesis_length += c;
    // Closest reference length; ties go to the shorter reference.
    std::int64_t best = std::numeric_limits<std::int64_t>::max(), best_len = 0;
    for (const auto& ref : refs) {
      const auto l = static_cast<std::int64_t>(ref.size());
      const auto d = std::abs(l - c);
      if (d < best || (d == best && l < best_len)) best = d, best_len = l;
    }
    r.reference_length += best_len;
    for (std::int64_t n = 1; n <= N; ++n) {
      const auto hc = detail::ngram_counts(h, n);
      std::map<tokens, std::int64_t> max_ref;
      for (const auto& ref : refs)
        for (const auto& [g, k] : detail::ngram_counts(ref, n)) max_ref[g] = std::max(max_ref[g], k);
      for (const auto& [g, k] : hc) {
        auto it = max_ref.find(g);
        if (it != max_ref.end()) matches[n - 1] += std::min(k, it->second);
      }
      totals[n - 1] += std::max<std::int64_t>(0, c - n + 1);
    }
  }
  const double c = static_cast<double>(r.hypothesis_length), ref = static_cast<double>(r.reference_length);
  r.brevity_penalty = c == 0 ? 0.0 : (c > ref ? 1.0 : std::exp(1.0 - ref / c));
  double log_sum = 0;
  bool zero = false;
  int k = 1;
  for (std::int64_t n = 0; n < N; ++n) {
    double num = static_cast<double>(matches[n]), den = static_cast<double>(totals[n]);
    double p;
    switch (o.smoothing) {
      case bleu_smoothing::epsilon: p = den > 0 ? (num > 0 ? num : o.epsilon) / den : 0.0; break;
      case bleu_smoothing::add_one: p = n == 0 ? (den > 0 ? num / den : 0.0) : (num + 1) / (den + 1); break;
      case bleu_smoothing::exponential:
        p = den > 0 ? (num > 0 ? num / den : 1.0 / (std::pow(2.0, k++) * den)) : 0.0;
        break;
      default: p = den > 0 ? num / den : 0.0;
    }
    r.precisions.push_back(p);
    if (p <= 0) zero = true;
    else log_sum += std::log(p) / static_cast<double>(N);
  }
  r.score = zero ? 0.0 : r.brevity_penalty * std::exp(log_sum);
  return r;
}

/// Corpus BLEU over text (tokenised by `o.tokenize`).
inline bleu_result corpus_bleu(const std::vector<std::string>& hypotheses,
                               const std::vector<std::vector<std::string>>& references, const bleu_options& o = {}) {
  std::vector<tokens> h;
  std::vector<std::vector<tokens>> r;
  for (const auto& s : hypotheses) h.push_back(tokenize(s, o));
  for (const auto& refs : references) {
    r.emplace_back();
    for (const auto& s : refs) r.back().push_back(tokenize(s, o));
  }
  return corpus_bleu(h, r, o);
}

/// Sentence BLEU of one hypothesis against its references (token sequences).
inline double sentence_bleu(const tokens& hypothesis, const std::vector<tokens>& references, const bleu_options& o = {}) {
  return corpus_bleu(std::vector<tokens>{hypothesis}, std::vector<std::vector<tokens>>{references}, o).score;
}

/// Sentence BLEU of one hypothesis against its references (text).
inline double sentence_bleu(const std::string& hypothesis, const std::vector<std::string>& references,
                            const bleu_options& o = {}) {
  return corpus_bleu(std::vector<std::string>{hypothesis}, std::vector<std::vector<std::string>>{references}, o).score;
}

}  // namespace unirl::eval

#pragma once
/// \file action_parser.hpp
/// Actions of a multimodal agent (seed 003 §8.1) parsed from the text a model wrote:
/// `click(12, 30)`, `scroll(12, 30, down)`, `type(12, 30, "7")`, and seed 003's short forms
/// for a page agent: `scroll(3)` (dy), `type("7")` (into the focused field), `navigate(shop)`.
/// Torch-free (the fuzz target
/// tests/fuzz/fuzz_action_parser.cpp builds it with libFuzzer); rewards/actions.hpp scores it.
///
/// ```cpp
/// auto r = unirl::rewards::parse_action("click(12, 30)");
/// if (r) use(r.action->x, r.action->y);          // r.action->type == action_type::click
/// else log(r.error);                             // "expected ',' at position 8, found ')'"
/// auto f = unirl::rewards::find_action("I will click(12, 30) now");   // first action in the text
/// ```
///
/// Grammar (ASCII; names and directions are case-insensitive; `ws` is spaces, tabs, newlines):
///
///     action    := ws (click | scroll | type | navigate) ws
///     click     := "click"  ws "(" ws num ws "," ws num ws ")"
///     scroll    := "scroll" ws "(" ws num ws ["," ws num ws "," ws (direction | num ws "," ws num) ws] ")"
///     type      := "type"   ws "(" ws [num ws "," ws num ws "," ws] string ws ")"
///     navigate  := "navigate" ws "(" ws (string | word) ws ")"
///     word      := (letter | digit | "_" | "-" | "/")+        -- at most max_text bytes
///     direction := "up" | "down" | "left" | "right"        -> (dx, dy) = (0,-1) (0,1) (-1,0) (1,0)
///     num       := ["+" | "-"] (digit+ ["." digit*] | "." digit+)   -- no exponent, inf or nan
///     string    := '"' (any byte but '"', '\' and control bytes | '\"' | '\\' | '\n' | '\t')* '"'
///
/// Coordinates are pixels of the image (x to the right, y down). The text a model wrote is
/// untrusted: `scroll(dy)` is a scroll by (0, dy) at (0, 0); `type("t")` types at (0, 0) (the
/// focused field); everything outside the grammar, a number of more than `max_number_chars`
/// characters or beyond `max_coordinate` in magnitude, a string longer than `max_text` bytes,
/// or an action longer than `max_length` bytes is a parse error with its reason and byte
/// position — never an exception, a crash or undefined behaviour, and in time linear in the text.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace unirl::rewards {

/// The kind of an agent action.
enum class action_type { click, scroll, type, navigate };

/// One parsed action: where, and what (a scroll's (dx, dy), a typed text).
struct action {
  action_type type = action_type::click;
  double x = 0.0, y = 0.0;    // pixel coordinates
  double dx = 0.0, dy = 0.0;  // scroll only: direction or amount
  std::string text;           // type: the unescaped text; navigate: the page
};

/// What `parse_action` returns: the action, or why the text is not one.
struct action_parse {
  std::optional<rewards::action> action;
  std::string error;          // empty when parsed
  std::size_t position = 0;   // byte offset of the error (parse_action) / of the action (find_action)

  bool ok() const { return action.has_value(); }
  explicit operator bool() const { return ok(); }
};

/// Limits on what the parser accepts (text a model wrote is untrusted).
struct action_limits {
  std::size_t max_length = 256;       // bytes of one action, whitespace included
  std::size_t max_number_chars = 24;  // characters of one number, sign and point included
  double max_coordinate = 1e6;        // |number| above this is refused
  std::size_t max_text = 64;          // bytes of a type action's text, after unescaping
};

/// The action in canonical form (`click(12, 30)`, `scroll(3, 4, 0, 1)`, `type(1, 2, "a\"b")`,
/// `navigate("shop")`);
/// parse_action reads it back to the same action (numbers rounded to 6 decimals).
inline std::string to_string(const action& a) {
  auto num = [](double v) {
    std::string s = std::to_string(v);  // fixed, 6 decimals: then trim zeros
    if (s.find('.') != std::string::npos) {
      while (!s.empty() && s.back() == '0') s.pop_back();
      if (!s.empty() && s.back() == '.') s.pop_back();
    }
    return s == "-0" ? std::string("0") : s;
  };
  auto quoted = [](const std::string& t) {
    std::string q = "\"";
    for (char c : t) {
      if (c == '"' || c == '\\') q += '\\', q += c;
      else if (c == '\n') q += "\\n";
      else if (c == '\t') q += "\\t";
      else q += c;
    }
    return q + "\"";
  };
  switch (a.type) {
    case action_type::click: return "click(" + num(a.x) + ", " + num(a.y) + ")";
    case action_type::scroll:
      return "scroll(" + num(a.x) + ", " + num(a.y) + ", " + num(a.dx) + ", " + num(a.dy) + ")";
    case action_type::type: return "type(" + num(a.x) + ", " + num(a.y) + ", " + quoted(a.text) + ")";
    case action_type::navigate: return "navigate(" + quoted(a.text) + ")";
  }
  return {};
}

namespace detail {

/// A cursor over one candidate action; every read is bounds-checked.
class action_reader {
 public:
  action_reader(std::string_view s, std::size_t start, const action_limits& lim) : s_(s), pos_(start), lim_(lim) {}

  /// Parses one action at the cursor. `whole`: only whitespace may follow it.
  action_parse parse(bool whole) {
    const std::size_t begin = pos_;
    skip_ws();
    action a;
    const std::size_t name_at = pos_;
    if (match_word("click")) a.type = action_type::click;
    else if (match_word("scroll")) a.type = action_type::scroll;
    else if (match_word("type")) a.type = action_type::type;
    else if (match_word("navigate")) a.type = action_type::navigate;
    else return fail("expected an action name (click, scroll, type or navigate)", name_at, quote(name_at));
    skip_ws();
    if (!expect('(')) return error_;
    skip_ws();
    if (a.type == action_type::navigate) {
      if (pos_ < s_.size() && s_[pos_] == '"') {
        if (!string(a.text)) return error_;
      } else if (!page(a.text)) return error_;
    } else if (a.type == action_type::type && pos_ < s_.size() && s_[pos_] == '"') {
      if (!string(a.text)) return error_;  // type("text"): the focused field
    } else {
      if (!number(a.x)) return error_;
      skip_ws();
      if (a.type == action_type::scroll && pos_ < s_.size() && s_[pos_] == ')') {
        a.dy = a.x;  // scroll(dy)
        a.x = 0;
      } else {
        if (!comma() || !number(a.y)) return error_;
        if (a.type == action_type::scroll) {
          if (!comma()) return error_;
          skip_ws();
          if (match_word("up")) a.dy = -1;
          else if (match_word("down")) a.dy = 1;
          else if (match_word("left")) a.dx = -1;
          else if (match_word("right")) a.dx = 1;
          else if (!number(a.dx) || !comma() || !number(a.dy)) return error_;
        } else if (a.type == action_type::type) {
          if (!comma() || !string(a.text)) return error_;
        }
      }
    }
    skip_ws();
    if (!expect(')')) return error_;
    end_ = pos_;
    if (whole) {
      skip_ws();
      if (pos_ < s_.size()) return fail("unexpected text after the action", pos_, quote(pos_));
    }
    if (end_ - begin > lim_.max_length)
      return fail("the action is " + std::to_string(end_ - begin) + " bytes long; expected at most " +
                      std::to_string(lim_.max_length),
                  begin, "");
    action_parse r;
    r.action = std::move(a);
    r.position = begin;
    return r;
  }

  std::size_t end() const { return end_; }

 private:
  static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
  static bool is_digit(char c) { return c >= '0' && c <= '9'; }
  static char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }
  static bool is_word(char c) { return is_digit(c) || (lower(c) >= 'a' && lower(c) <= 'z') || c == '_'; }

  void skip_ws() {
    while (pos_ < s_.size() && is_ws(s_[pos_])) ++pos_;
  }
  // A case-insensitive keyword not followed by a word character.
  bool match_word(std::string_view w) {
    if (s_.size() - pos_ < w.size()) return false;
    for (std::size_t i = 0; i < w.size(); ++i)
      if (lower(s_[pos_ + i]) != w[i]) return false;
    if (pos_ + w.size() < s_.size() && is_word(s_[pos_ + w.size()])) return false;
    pos_ += w.size();
    return true;
  }
  bool expect(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    (void)fail(std::string("expected '") + c + "'", pos_, quote(pos_));
    return false;
  }
  bool comma() {
    skip_ws();
    if (!expect(',')) return false;
    skip_ws();
    return true;
  }
  bool number(double& out) {
    skip_ws();
    const std::size_t start = pos_;
    std::size_t p = pos_;
    if (p < s_.size() && (s_[p] == '+' || s_[p] == '-')) ++p;
    std::size_t int_digits = 0, frac_digits = 0;
    while (p < s_.size() && is_digit(s_[p])) ++p, ++int_digits;
    if (p < s_.size() && s_[p] == '.') {
      ++p;
      while (p < s_.size() && is_digit(s_[p])) ++p, ++frac_digits;
    }
    if (int_digits + frac_digits == 0) {
      (void)fail("expected a number", start, quote(start));
      return false;
    }
    if (p < s_.size() && (is_word(s_[p]) || s_[p] == '.')) {  // 1e5, 12px, 0x1F, 1.2.3, inf after a sign ...
      (void)fail("malformed number", start, quote(start));
      return false;
    }
    if (p - start > lim_.max_number_chars) {
      (void)fail("a number of " + std::to_string(p - start) + " characters; expected at most " +
                     std::to_string(lim_.max_number_chars),
                 start, "");
      return false;
    }
    // At most max_number_chars plain characters: strtod on a bounded, NUL-terminated copy.
    const std::string text(s_.substr(start, p - start));
    const double v = std::strtod(text.c_str(), nullptr);
    if (!(std::abs(v) <= lim_.max_coordinate)) {
      std::ostringstream bound;
      bound << lim_.max_coordinate;
      (void)fail("the number " + text + " is beyond +-" + bound.str(), start, "");
      return false;
    }
    out = v == 0.0 ? 0.0 : v;  // no negative zero
    pos_ = p;
    return true;
  }
  bool string(std::string& out) {
    skip_ws();
    const std::size_t start = pos_;
    if (!expect('"')) return false;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return true;
      }
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        (void)fail("a control byte inside the text", pos_, "");
        return false;
      }
      char add = c;
      if (c == '\\') {
        if (pos_ + 1 >= s_.size()) break;
        const char e = s_[pos_ + 1];
        if (e == '"' || e == '\\') add = e;
        else if (e == 'n') add = '\n';
        else if (e == 't') add = '\t';
        else {
          (void)fail("unknown escape in the text; expected \\\" \\\\ \\n or \\t", pos_, quote(pos_));
          return false;
        }
        ++pos_;
      }
      if (out.size() >= lim_.max_text) {
        (void)fail("the text is longer than " + std::to_string(lim_.max_text) + " bytes", start, "");
        return false;
      }
      out += add;
      ++pos_;
    }
    (void)fail("unterminated text (no closing '\"')", start, "");
    return false;
  }
  // A bare page name: letters, digits, '_', '-', '/' (at most max_text bytes).
  bool page(std::string& out) {
    const std::size_t start = pos_;
    while (pos_ < s_.size() && (is_word(s_[pos_]) || s_[pos_] == '-' || s_[pos_] == '/')) {
      if (out.size() >= lim_.max_text) {
        (void)fail("the page name is longer than " + std::to_string(lim_.max_text) + " bytes", start, "");
        return false;
      }
      out += s_[pos_++];
    }
    if (out.empty()) {
      (void)fail("expected a page name", start, quote(start));
      return false;
    }
    return true;
  }

  // A short, printable excerpt of the text at `p` for error messages.
  std::string quote(std::size_t p) const {
    if (p >= s_.size()) return "found the end of the text";
    std::string q;
    for (std::size_t i = p; i < s_.size() && q.size() < 12; ++i) {
      const auto c = static_cast<unsigned char>(s_[i]);
      q += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
    }
    return "found '" + q + "'";
  }

  action_parse fail(std::string what, std::size_t at, const std::string& found) {
    error_ = action_parse{};
    error_.error = what + " at position " + std::to_string(at) + (found.empty() ? "" : ", " + found);
    error_.position = at;
    return error_;
  }

  std::string_view s_;
  std::size_t pos_ = 0, end_ = 0;
  const action_limits& lim_;
  action_parse error_;
};

}  // namespace detail

/// Parses `text` as exactly one action (surrounding whitespace allowed). Never throws for any text.
inline action_parse parse_action(std::string_view text, const action_limits& limits = {}) {
  if (text.size() > limits.max_length + 64) {  // whitespace around an action is bounded too
    action_parse r;
    r.error = "the text is " + std::to_string(text.size()) + " bytes long; expected an action of at most " +
              std::to_string(limits.max_length);
    return r;
  }
  detail::action_reader reader(text, 0, limits);
  return reader.parse(/*whole=*/true);
}

/// The first action written anywhere in `text` (e.g. after some reasoning): the first place
/// where an action name (at a word start) begins a well-formed action. Its `position` is where
/// the action starts. When none parses, the error of the first candidate (or "no action").
/// Linear in the text: each candidate reads at most `max_length` bytes.
inline action_parse find_action(std::string_view text, const action_limits& limits = {}) {
  std::optional<action_parse> first_error;
  auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = lower(text[i]);
    if (c != 'c' && c != 's' && c != 't' && c != 'n') continue;
    if (i > 0) {
      const char p = lower(text[i - 1]);
      if ((p >= 'a' && p <= 'z') || (p >= '0' && p <= '9') || p == '_') continue;
    }
    // Bound the look-ahead: an action is at most max_length bytes (positions stay absolute).
    const std::string_view window = text.substr(0, i + limits.max_length + 1);
    detail::action_reader reader(window, i, limits);
    auto r = reader.parse(/*whole=*/false);
    if (r) return r;
    // Only a candidate that got past its name is worth reporting.
    if (!first_error && r.position > i) {
      first_error = r;
      first_error->error = "the action at position " + std::to_string(i) + ": " + r.error;
    }
  }
  if (first_error) return *first_error;
  action_parse none;
  none.error = "no action (click, scroll, type or navigate) in the text";
  return none;
}

}  // namespace unirl::rewards

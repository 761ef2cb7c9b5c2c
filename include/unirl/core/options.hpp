#pragma once
/// \file options.hpp
/// Reflection of `options` aggregates (Boost.Hana): print them, load them from a recipe file
/// (JSON, or YAML when built with yaml-cpp), override them from `key=value` arguments, and
/// validate their ranges. Every error names the dotted key and the offending value.
///
/// An options type stays an aggregate (designated initializers keep working) and is adapted
/// after its definition:
/// ```cpp
/// struct my_options { float lr = 1e-3f; int steps = 100; };
/// BOOST_HANA_ADAPT_STRUCT(my_options, lr, steps);
///
/// my_options o{.lr = 3e-4f};
/// unirl::options::apply_overrides(o, {"steps=20"});   // o.steps == 20
/// unirl::options::to_string(o);                       // "lr = 0.0003\nsteps = 20\n"
/// ```
/// Minimal complete definition of a reflectable options type: `BOOST_HANA_ADAPT_STRUCT` (or a
/// `boost::hana::accessors_impl` specialisation) whose members are bool, integers, floating
/// point, `std::string`, enums with `unirl::enum_names`, `std::vector` of those, or reflectable
/// options types themselves. Optionally `void validate(const std::string& prefix) const`, which
/// throws `unirl::config_error` naming `prefix + "member"` for an out-of-range value.
#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#if defined(UNIRL_WITH_YAML)
#include <yaml-cpp/yaml.h>
#endif

#include <unirl/config.hpp>
#include <unirl/core/error.hpp>

namespace unirl {

/// Names of an enum's enumerators, indexed by their underlying value (0, 1, 2, ...).
/// Specialise for every enum used in an options type:
/// `template <> inline constexpr std::array unirl::enum_names<mode>{"a", "b"};`
template <class E>
inline constexpr std::array<std::string_view, 0> enum_names{};

/// Text of an enumerator, from `enum_names`.
template <class E>
  requires std::is_enum_v<E>
std::string_view enum_to_string(E e) {
  const auto i = static_cast<std::size_t>(e);
  return i < enum_names<E>.size() ? enum_names<E>[i] : std::string_view{"<unknown>"};
}

namespace options {

/// One line of `help` for a member of an options struct: `name` is the member (or, to hide a
/// key of a nested struct that this struct fixes itself, a dotted path below it), `text` its
/// one-line description; `hidden` keeps it (and everything under it) out of `help`.
struct field_doc {
  std::string_view name;
  std::string_view text;
  bool hidden = false;
};

/// The descriptions of the members of `T`, written once next to the struct (after its
/// `BOOST_HANA_ADAPT_STRUCT`); `help` prints them. Specialise with an array of `field_doc`:
/// ```cpp
/// template <>
/// inline constexpr std::array unirl::options::field_docs<my_options>{
///     unirl::options::field_doc{"lr", "learning rate"}, unirl::options::field_doc{"steps", "optimizer steps"}};
/// ```
template <class T>
inline constexpr std::array<field_doc, 0> field_docs{};

/// True for types adapted with Boost.Hana (nested options structs). The concept spelled on it,
/// `unirl::Reflectable` (also `unirl::options::Reflectable`), is in concepts/options.hpp: core/
/// sits below concepts/ and names none.
template <class T>
inline constexpr bool is_reflectable = boost::hana::Struct<T>::value;

namespace detail {
// Converts to any member type, by reference so that no constructor of the member competes:
// `T{any_member{}, ...}` with N of them is valid exactly when the aggregate T has >= N members.
struct any_member {
  template <class M>
  operator M&() const;  // NOLINT: declared only, used in unevaluated contexts
};
template <std::size_t>
using any_member_t = any_member;
template <class T, std::size_t... I>
constexpr bool initializable_with(std::index_sequence<I...>) {
  return requires { T{any_member_t<I>{}...}; };
}
template <class T, std::size_t N = 0>
constexpr std::size_t count_members() {
  if constexpr (N < 128 && initializable_with<T>(std::make_index_sequence<N + 1>{})) return count_members<T, N + 1>();
  else return N;
}
}  // namespace detail

/// Number of members of the aggregate `T`, counted by aggregate initialisation (no reflection).
template <class T>
  requires std::is_aggregate_v<T>
inline constexpr std::size_t member_count = detail::count_members<T>();

/// True when the reflection of the aggregate `T` (its `BOOST_HANA_ADAPT_STRUCT` or hand-written
/// accessor table) lists as many members as `T` has: a member added to the struct but not to its
/// list makes it false. tests/static asserts it for every options type of the library.
template <class T>
  requires is_reflectable<T> && std::is_aggregate_v<T>
inline constexpr bool reflects_every_member =
    member_count<T> == decltype(boost::hana::length(boost::hana::accessors<T>()))::value;

namespace detail {
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

template <class T>
struct is_struct_list : std::false_type {};
template <class T, class A>
struct is_struct_list<std::vector<T, A>> : std::bool_constant<is_reflectable<T>> {};

// JSON text for messages: invalid UTF-8 (a YAML recipe may carry any bytes) is replaced, not thrown.
inline std::string dump_text(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline std::string join(const std::string& prefix, const char* name) {
  return prefix.empty() ? std::string(name) : prefix + "." + name;
}

template <class T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, bool>) return "a boolean (true/false)";
  else if constexpr (std::is_enum_v<T>) return "one of the names listed";
  else if constexpr (std::is_integral_v<T>) return "an integer";
  else if constexpr (std::is_floating_point_v<T>) return "a number";
  else if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (is_vector<T>::value) return "a list";
  else return "an object";
}

template <class E>
std::string enum_choices() {
  std::string s;
  for (auto n : enum_names<E>) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

template <class T>
void from_json_value(T& out, const nlohmann::json& j, const std::string& key);

// Parses one value from text (command line) into `out`; structs and lists of structs as JSON.
template <class T>
void parse_text(T& out, const std::string& key, const std::string& text) {
  auto bad = [&](const std::string& why) {
    throw config_error(key, "cannot read '" + text + "' as " + type_name<T>() + why);
  };
  if constexpr (is_reflectable<T> || is_struct_list<T>::value) {
    nlohmann::json j;
    try { j = nlohmann::json::parse(text); } catch (const std::exception&) { bad(" (expected JSON)"); }
    from_json_value(out, j, key);
  } else if constexpr (std::is_same_v<T, bool>) {
    if (text == "true" || text == "1" || text == "on" || text == "yes") out = true;
    else if (text == "false" || text == "0" || text == "off" || text == "no") out = false;
    else bad("");
  } else if constexpr (std::is_enum_v<T>) {
    for (std::size_t i = 0; i < enum_names<T>.size(); ++i)
      if (enum_names<T>[i] == text) { out = static_cast<T>(i); return; }
    bad(" (expected one of: " + enum_choices<T>() + ")");
  } else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T>) {
    // stoull would wrap "-1" around to the largest value: a sign is refused here.
    std::size_t pos = 0;
    unsigned long long v = 0;
    if (text.find('-') != std::string::npos) bad(" (out of the type's range)");
    try { v = std::stoull(text, &pos); } catch (const std::out_of_range&) { bad(" (out of the type's range)"); } catch (...) { bad(""); }
    if (pos != text.size()) bad("");
    if (v > static_cast<unsigned long long>(std::numeric_limits<T>::max())) bad(" (out of the type's range)");
    out = static_cast<T>(v);
  } else if constexpr (std::is_integral_v<T>) {
    std::size_t pos = 0;
    long long v = 0;
    try { v = std::stoll(text, &pos); } catch (const std::out_of_range&) { bad(" (out of the type's range)"); } catch (...) { bad(""); }
    if (pos != text.size()) bad("");
    if (v < static_cast<long long>(std::numeric_limits<T>::min()) || v > static_cast<long long>(std::numeric_limits<T>::max()))
      bad(" (out of the type's range)");
    out = static_cast<T>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    std::size_t pos = 0;
    double v = 0;
    try { v = std::stod(text, &pos); } catch (...) { bad(""); }
    if (pos != text.size()) bad("");
    // A finite double beyond float's range cannot be converted (undefined behaviour).
    if (std::isfinite(v) && std::abs(v) > static_cast<double>(std::numeric_limits<T>::max())) bad(" (out of the type's range)");
    out = static_cast<T>(v);
  } else if constexpr (std::is_same_v<T, std::string>) {
    out = text;
  } else if constexpr (is_vector<T>::value) {
    std::string body = text;
    if (!body.empty() && body.front() == '[') body = body.substr(1);
    if (!body.empty() && body.back() == ']') body.pop_back();
    T result;
    std::stringstream ss(body);
    std::string item;
    std::size_t i = 0;
    while (std::getline(ss, item, ',')) {
      while (!item.empty() && item.front() == ' ') item.erase(item.begin());
      while (!item.empty() && item.back() == ' ') item.pop_back();
      if (item.empty()) continue;
      typename T::value_type v{};
      parse_text(v, key + "[" + std::to_string(i++) + "]", item);
      result.push_back(v);
    }
    out = std::move(result);
  } else {
    static_assert(unirl::detail::dependent_false<T>, "unirl::options: unsupported member type");
  }
}

template <class T>
nlohmann::json to_json_value(const T& v);

template <class T>
std::string value_text(const T& v) {
  if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
  else if constexpr (is_reflectable<T>) return dump_text(to_json_value(v));
  else if constexpr (std::is_enum_v<T>) return std::string(enum_to_string(v));
  else if constexpr (std::is_same_v<T, std::string>) return "\"" + v + "\"";
  else if constexpr (is_vector<T>::value) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + value_text(v[i]);
    return s + "]";
  } else {
    std::ostringstream os;
    os << v;
    return os.str();
  }
}

template <class T>
void from_json_value(T& out, const nlohmann::json& j, const std::string& key);

// Levenshtein distance between two keys.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "; did you mean K?" for the known key K nearest to `key` (the first of equals), when it is near
// enough: at most a third of the length of the key's last component (and at least 1) edits away
// — a typo, not another word; "" otherwise.
inline std::string suggestion(const std::string& key, const std::vector<std::string>& known) {
  const std::string* best = nullptr;
  std::size_t best_d = 0;
  for (const auto& k : known) {
    const auto d = edit_distance(key, k);
    if (!best || d < best_d) best = &k, best_d = d;
  }
  const auto dot = key.rfind('.');
  const std::size_t last = dot == std::string::npos ? key.size() : key.size() - dot - 1;
  if (!best || best_d == 0 || best_d > std::max<std::size_t>(1, last / 3)) return "";
  return "; did you mean " + *best + "?";
}

// Every dotted key of `T` (leaves and groups), prefixed with `prefix`.
template <class T>
void collect_keys(std::vector<std::string>& out, const std::string& prefix) {
  boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
    const std::string key = join(prefix, boost::hana::to<const char*>(boost::hana::first(pair)));
    out.push_back(key);
    using M = std::remove_cvref_t<decltype(boost::hana::second(pair)(std::declval<T&>()))>;
    if constexpr (is_reflectable<M>) collect_keys<M>(out, key);
  });
}

// Calls `f(member, name)` on the member of `obj` named `key` and says whether `T` has one: the
// one name lookup that reading JSON, reporting unknown keys and `set` share.
template <class T, class F>
bool with_member(T& obj, std::string_view key, F&& f) {
  bool found = false;
  boost::hana::for_each(boost::hana::accessors<std::remove_const_t<T>>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    if (found || key != name) return;
    found = true;
    f(boost::hana::second(pair)(obj), name);
  });
  return found;
}

template <class T>
  requires is_reflectable<T>
void from_json_object(T& out, const nlohmann::json& j, const std::string& prefix) {
  if (!j.is_object())
    throw config_error(prefix.empty() ? "<root>" : prefix, "expected an object, got " + dump_text(j));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const bool found = with_member(out, it.key(), [&](auto& member, const char* name) {
      from_json_value(member, it.value(), join(prefix, name));
    });
    if (!found) {
      std::vector<std::string> known;
      boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
        known.push_back(join(prefix, boost::hana::to<const char*>(boost::hana::first(pair))));
      });
      const std::string key = join(prefix, it.key().c_str());
      throw config_error(key, "unknown key" + suggestion(key, known));
    }
  }
}

template <class T>
void from_json_value(T& out, const nlohmann::json& j, const std::string& key) {
  auto wrong = [&] {
    throw config_error(key, std::string("expected ") + type_name<T>() + ", got " + dump_text(j));
  };
  if constexpr (is_reflectable<T>) {
    from_json_object(out, j, key);
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) wrong();
    out = j.get<bool>();
  } else if constexpr (std::is_enum_v<T>) {
    if (!j.is_string()) wrong();
    parse_text(out, key, j.get<std::string>());
  } else if constexpr (std::is_integral_v<T>) {
    // Through the text path, which range-checks (a double such as 1e19 is not cast to long long).
    if (j.is_number_unsigned()) parse_text(out, key, std::to_string(j.get<unsigned long long>()));
    else if (j.is_number_integer()) parse_text(out, key, std::to_string(j.get<long long>()));
    else if (j.is_number_float() && std::trunc(j.get<double>()) == j.get<double>()) {
      char text[400];
      std::snprintf(text, sizeof text, "%.0f", j.get<double>());
      parse_text(out, key, text);
    } else wrong();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!j.is_number()) wrong();
    const double v = j.get<double>();
    if (std::isfinite(v) && std::abs(v) > static_cast<double>(std::numeric_limits<T>::max()))
      throw config_error(key, "value " + dump_text(j) + " is out of the range of the option's floating-point type");
    out = static_cast<T>(v);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!j.is_string()) wrong();
    out = j.get<std::string>();
  } else if constexpr (is_vector<T>::value) {
    if (!j.is_array()) wrong();
    T result(j.size());
    for (std::size_t i = 0; i < j.size(); ++i)
      from_json_value(result[i], j[i], key + "[" + std::to_string(i) + "]");
    out = std::move(result);
  } else {
    static_assert(unirl::detail::dependent_false<T>, "unirl::options: unsupported member type");
  }
}

template <class T>
nlohmann::json to_json_value(const T& v) {
  if constexpr (is_reflectable<T>) {
    nlohmann::json j = nlohmann::json::object();
    boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
      j[boost::hana::to<const char*>(boost::hana::first(pair))] =
          to_json_value(boost::hana::second(pair)(v));
    });
    return j;
  } else if constexpr (std::is_enum_v<T>) {
    return std::string(enum_to_string(v));
  } else if constexpr (is_vector<T>::value) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& x : v) j.push_back(to_json_value(x));
    return j;
  } else {
    return v;
  }
}

template <class T>
void print_into(std::ostream& os, const T& v, const std::string& prefix) {
  boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    const auto& member = boost::hana::second(pair)(v);
    using M = std::remove_cvref_t<decltype(member)>;
    if constexpr (is_reflectable<M>) print_into(os, member, join(prefix, name));
    else os << join(prefix, name) << " = " << value_text(member) << "\n";
  });
}

// The one-word type of a leaf for `help`: "integer", "number", "true|false", "a|b|c", ...
template <class T>
std::string help_type() {
  if constexpr (std::is_same_v<T, bool>) return "true|false";
  else if constexpr (std::is_enum_v<T>) {
    std::string s;
    for (const auto n : enum_names<T>) {
      if (!s.empty()) s.push_back('|');
      s.append(n.begin(), n.end());
    }
    return s;
  } else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else if constexpr (std::is_same_v<T, std::string>) return "string";
  else if constexpr (is_struct_list<T>::value) return "list of objects (JSON)";
  else if constexpr (is_vector<T>::value) return "list of " + help_type<typename T::value_type>();
  else return "object";
}

inline bool under(const std::string& key, const std::vector<std::string>& paths) {
  for (const auto& p : paths)
    if (key == p || (key.size() > p.size() && key.compare(0, p.size(), p) == 0 && key[p.size()] == '.')) return true;
  return false;
}

template <class T>
void help_into(std::ostream& os, const T& v, const std::string& prefix, std::vector<std::string>& hidden) {
  for (const auto& d : field_docs<T>)
    if (d.hidden) hidden.push_back(join(prefix, std::string(d.name).c_str()));
  boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    const std::string key = join(prefix, name);
    if (under(key, hidden)) return;
    const auto& member = boost::hana::second(pair)(v);
    using M = std::remove_cvref_t<decltype(member)>;
    if constexpr (is_reflectable<M>) {
      help_into(os, member, key, hidden);
    } else {
      os << key << " = " << value_text(member) << "  [" << help_type<M>() << "]\n";
      for (const auto& d : field_docs<T>)
        if (d.name == name && !d.text.empty()) os << "    " << d.text << "\n";
    }
  });
}

// Every key of `j` that `T` does not have, each with its "; did you mean" suggestion.
template <class T>
void unknown_into(const nlohmann::json& j, const std::string& prefix, std::vector<std::string>& out) {
  if (!j.is_object()) return;
  const T probe{};
  for (auto it = j.begin(); it != j.end(); ++it) {
    const bool found = with_member(probe, it.key(), [&](const auto& member, const char* name) {
      using M = std::remove_cvref_t<decltype(member)>;
      if constexpr (is_reflectable<M>) unknown_into<M>(it.value(), join(prefix, name), out);
    });
    if (!found) {
      std::vector<std::string> known;
      collect_keys<T>(known, prefix);
      const std::string key = join(prefix, it.key().c_str());
      out.push_back(key + suggestion(key, known));
    }
  }
}

template <class T>
bool set_path(T& obj, std::string_view path, const std::string& full_key, const std::string& value) {
  const auto dot = path.find('.');
  const std::string_view head = path.substr(0, dot);
  bool done = false;
  with_member(obj, head, [&](auto& member, const char*) {
    using M = std::remove_cvref_t<decltype(member)>;
    if constexpr (is_reflectable<M>) {
      if (dot == std::string_view::npos)
        throw config_error(full_key, "is a group of options; set one of its members, e.g. '" +
                                         full_key + ".<name>=...'");
      done = set_path(member, path.substr(dot + 1), full_key, value);
    } else {
      if (dot != std::string_view::npos) return;
      parse_text(member, full_key, value);
      done = true;
    }
  });
  return done;
}

template <class T>
void validate_into(const T& v, const std::string& prefix) {
  boost::hana::for_each(boost::hana::accessors<T>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    const auto& member = boost::hana::second(pair)(v);
    using M = std::remove_cvref_t<decltype(member)>;
    if constexpr (is_reflectable<M>) validate_into(member, join(prefix, name));
  });
  if constexpr (requires(const std::string& p) { v.validate(p); })
    v.validate(prefix.empty() ? std::string{} : prefix + ".");
}
}  // namespace detail

/// `key = value` lines, one per leaf option, nested keys dotted.
template <class T>
  requires is_reflectable<T>
std::string to_string(const T& opts) {
  std::ostringstream os;
  detail::print_into(os, opts, "");
  return os.str();
}

/// The options as a JSON object (enums as their names).
template <class T>
  requires is_reflectable<T>
nlohmann::json to_json(const T& opts) { return detail::to_json_value(opts); }

/// Overwrites the members present in `j`; an unknown key or a wrong type throws `config_error`.
template <class T>
  requires is_reflectable<T>
void from_json(T& opts, const nlohmann::json& j) { detail::from_json_object(opts, j, ""); }

/// Sets one option by its dotted key from text: `set(o, "algorithm.clip_high", "0.28")`.
template <class T>
  requires is_reflectable<T>
void set(T& opts, const std::string& key, const std::string& value) {
  if (!detail::set_path(opts, key, key, value)) {
    std::vector<std::string> known;
    detail::collect_keys<T>(known, "");
    throw config_error(key, "unknown key" + detail::suggestion(key, known));
  }
}

/// `--help` text: one entry per settable leaf option, `key = default  [type]` and, indented on
/// the next line, its description from `field_docs` (when it has one); keys a `field_doc` marks
/// `hidden` are left out.
/// ```cpp
/// std::cout << unirl::options::help(my_options{});
/// // lr = 0.001  [number]
/// //     learning rate
/// ```
template <class T>
  requires is_reflectable<T>
std::string help(const T& defaults) {
  std::ostringstream os;
  std::vector<std::string> hidden;
  detail::help_into(os, defaults, "", hidden);
  return os.str();
}

/// Every key of a recipe object `j` that `T` lacks, dotted, each followed by its "; did you
/// mean ...?" suggestion when one is near: all of them at once, for one error message.
template <class T>
  requires is_reflectable<T>
std::vector<std::string> unknown_keys(const nlohmann::json& j) {
  std::vector<std::string> out;
  detail::unknown_into<T>(j, "", out);
  return out;
}

/// True when `key` (dotted) names an option or a group of options of `T`.
template <class T>
  requires is_reflectable<T>
bool has_key(const std::string& key) {
  std::vector<std::string> known;
  detail::collect_keys<T>(known, "");
  return std::find(known.begin(), known.end(), key) != known.end();
}

/// The "; did you mean K?" text for an unknown `key` of `T` ("" when no key is near).
template <class T>
  requires is_reflectable<T>
std::string key_suggestion(const std::string& key) {
  std::vector<std::string> known;
  detail::collect_keys<T>(known, "");
  return detail::suggestion(key, known);
}

/// Runs every `validate(prefix)` member of the options tree; throws `config_error` on a bad value.
template <class T>
  requires is_reflectable<T>
void validate(const T& opts) { detail::validate_into(opts, ""); }

/// Applies `key=value` arguments in order, then validates. Arguments without '=' are rejected.
template <class T>
  requires is_reflectable<T>
void apply_overrides(T& opts, const std::vector<std::string>& args) {
  for (const auto& a : args) {
    const auto eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      throw config_error(a, "expected an override of the form key=value");
    set(opts, a.substr(0, eq), a.substr(eq + 1));
  }
  validate(opts);
}

#if defined(UNIRL_WITH_YAML)
namespace detail {
inline nlohmann::json yaml_to_json(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::json j = nlohmann::json::object();
      for (const auto& kv : n) j[kv.first.as<std::string>()] = yaml_to_json(kv.second);
      return j;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& x : n) j.push_back(yaml_to_json(x));
      return j;
    }
    case YAML::NodeType::Scalar: {
      const auto s = n.Scalar();
      if (n.Tag() == "!") return s;  // quoted scalar
      if (s == "true" || s == "false") return s == "true";
      try { std::size_t p = 0; long long v = std::stoll(s, &p); if (p == s.size()) return v; } catch (...) {}
      try { std::size_t p = 0; double v = std::stod(s, &p); if (p == s.size()) return v; } catch (...) {}
      return s;
    }
    default:
      return nullptr;
  }
}
}  // namespace detail
#endif

/// Reads a recipe file as JSON: `.json`, or `.yaml` / `.yml` when unirl was built with yaml-cpp.
/// A missing or malformed file is a `config_error` naming it.
inline nlohmann::json read_recipe(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw config_error("<recipe>", "cannot open recipe file '" + path + "'");
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  nlohmann::json j;
  if (yaml) {
#if defined(UNIRL_WITH_YAML)
    try {
      j = detail::yaml_to_json(YAML::LoadFile(path));
    } catch (const YAML::Exception& e) {
      throw config_error("<recipe>", "'" + path + "' is not valid YAML: " + e.what());
    }
#else
    throw config_error("<recipe>", "'" + path + "' is YAML but unirl was built without yaml-cpp; use JSON");
#endif
  } else {
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw config_error("<recipe>", "'" + path + "' is not valid JSON: " + e.what());
    }
  }
  return j;
}

/// Loads a recipe (see `read_recipe`) into `opts` and validates.
template <class T>
  requires is_reflectable<T>
void load_recipe(T& opts, const std::string& path) {
  // Qualified: nlohmann-json >= 3.11 declares its own from_json(BasicJsonType, T&), which ADL
  // finds through the json argument and makes an unqualified call ambiguous.
  ::unirl::options::from_json(opts, read_recipe(path));
  validate(opts);
}

/// Parses `text` as a `T` (as an option value would be); a bad value is a `config_error` naming `key`.
template <class T>
T parse_value(const std::string& key, const std::string& text) {
  T v{};
  detail::parse_text(v, key, text);
  return v;
}

/// Throws `config_error(key, ...)` naming the value unless `ok`.
template <class V>
void require(bool ok, const std::string& key, const V& value, std::string_view expected) {
  if (!ok) throw config_error(key, "value " + detail::value_text(value) + " is out of range: expected " + std::string(expected));
}

}  // namespace options
}  // namespace unirl

// The command-line reader moved to its own header; included here for one release so that code
// written against this header keeps compiling.
#include <unirl/core/command_line.hpp>

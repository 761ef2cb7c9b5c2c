#pragma once
/// \file command_line.hpp
/// A program's command line over its options: `--recipe FILE`, `key=value` overrides (then
/// validated) and the program's own `--flags`. The options reflection it drives is
/// core/options.hpp (which still includes this header, for one release, so that older code
/// compiles).
///
/// ```cpp
/// #include <unirl/core/command_line.hpp>
/// my_options opts;
/// auto flags = unirl::options::parse_command_line(opts, argc, argv, {{"out", "runs/x"}, {"help", "false"}});
/// // prog --recipe r.yaml optim.lr=3e-4 --out runs/y   ->   flags["out"] == "runs/y"
/// ```
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::options {

/// Reads `--recipe FILE` (or `--recipe=FILE`) and `key=value` arguments from a command line;
/// other arguments starting with "--" are returned for the caller to interpret.
template <class T>
  requires is_reflectable<T>
std::vector<std::string> parse_command_line(T& opts, int argc, const char* const* argv) {
  std::vector<std::string> overrides, rest;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--recipe" && i + 1 < argc) load_recipe(opts, argv[++i]);
    else if (a.starts_with("--recipe=")) load_recipe(opts, a.substr(9));
    else if (a.starts_with("--") || a == "-h") {
      rest.push_back(a);
      if (a.find('=') == std::string::npos && i + 1 < argc && std::string(argv[i + 1]).find('=') == std::string::npos &&
          !std::string(argv[i + 1]).starts_with("--"))
        rest.push_back(argv[++i]);
    } else overrides.push_back(a);
  }
  apply_overrides(opts, overrides);
  return rest;
}

/// The usage text of a program whose command line `parse_command_line` reads: its flags with
/// their defaults, then every option (`help`: key = default, type, description).
template <class T>
  requires is_reflectable<T>
std::string usage(const std::string& program, const T& opts, const std::map<std::string, std::string>& flags) {
  const auto slash = program.find_last_of('/');
  std::string u = "usage: " + (slash == std::string::npos ? program : program.substr(slash + 1)) +
                  " [--recipe FILE] [--flag VALUE ...] [key=value ...]\n\nflags:\n";
  for (const auto& [name, def] : flags)
    u += "  --" + name + (def == "false" ? std::string("  (a switch)") : " VALUE  (default: " + def + ")") + "\n";
  return u + "  --recipe FILE  (a JSON or YAML file of options)\n\noptions (key=value; key = default  [type]):\n" +
         help(opts);
}

/// Reads a program's command line: `--recipe FILE`, `key=value` overrides (then validated), and
/// the program's own flags, declared with their defaults: `--name VALUE` or `--name=VALUE`; a
/// flag whose default is "false" is a switch (`--name` alone sets it to "true"). Returns every
/// declared flag's value. An undeclared flag, or one missing its value, is a `config_error`.
/// `--help` or `-h`: a program that declares a "help" flag gets it set to "true" (nothing else
/// is read); any other prints `usage` to stdout and exits with status 0.
/// ```cpp
/// auto flags = unirl::options::parse_command_line(opts, argc, argv, {{"out", "runs/x"}, {"help", "false"}});
/// std::filesystem::create_directories(flags["out"]);
/// ```
template <class T>
  requires is_reflectable<T>
std::map<std::string, std::string> parse_command_line(T& opts, int argc, const char* const* argv,
                                                      std::map<std::string, std::string> flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a != "--help" && a != "-h") continue;
    if (const auto it = flags.find("help"); it != flags.end()) {
      it->second = "true";
      return flags;
    }
    std::cout << usage(argc > 0 ? argv[0] : "program", opts, flags) << std::flush;
    std::exit(0);
  }
  const auto rest = parse_command_line(opts, argc, argv);
  auto known = [&] {
    std::string k;
    for (const auto& [name, def] : flags) k += "--" + name + (def == "false" ? "" : " VALUE") + ", ";
    return k + "--recipe FILE or key=value";
  };
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const std::string& a = rest[i];
    if (!a.starts_with("--")) throw config_error(a, "unexpected argument; expected " + known());
    const auto eq = a.find('=');
    const std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const auto it = flags.find(name);
    if (it == flags.end()) throw config_error("--" + name, "unknown flag; expected " + known());
    if (eq != std::string::npos) it->second = a.substr(eq + 1);
    else if (it->second == "false") it->second = "true";
    else if (i + 1 < rest.size() && !rest[i + 1].starts_with("--")) it->second = rest[++i];
    else throw config_error("--" + name, "flag without a value");
  }
  return flags;
}

}  // namespace unirl::options

// unirl-train: RL post-training of a Hugging Face causal LM from a recipe.
//
//   unirl-train --recipe recipe.yaml [key=value ...]
//   unirl-train model=path/to/hf_dir data.path=train.jsonl algorithm=dapo steps=200 out=runs/x
//   unirl-train --print-recipe [--recipe r.yaml] [key=value ...]   # the resolved recipe, as JSON
//   unirl-train --help                                             # every key: type, default, meaning
//
// Everything it does is `unirl::recipes::run` (include/unirl/recipes/token_recipe.hpp): the
// library's trainer, models, tokenizer, data and rewards; see docs/unirl-train.md.
//
// Exit status: 0 done; 1 an error (one line naming the option or the file); 130 / 143 stopped by
// SIGINT / SIGTERM after writing a checkpoint (the same command resumes), or at once on a second
// signal.
#include <csignal>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include <unirl/core/signals.hpp>
#include <unirl/recipes/token_recipe.hpp>

namespace {
const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "a signal";
  }
}
}  // namespace

int main(int argc, char** argv) try {
  std::string recipe;
  bool print = false, help = false;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--recipe" && i + 1 < argc) recipe = argv[++i];
    else if (a.starts_with("--recipe=")) recipe = a.substr(9);
    else if (a == "--print-recipe") print = true;
    else if (a == "--help" || a == "-h") help = true;
    else if (a.find('=') != std::string::npos && !a.starts_with("--")) overrides.push_back(a);
    else throw unirl::config_error(a, "unexpected argument; expected --recipe FILE, --print-recipe, --help or key=value");
  }
  unirl::recipes::token_recipe r;
  if (help) {
    std::cout << "usage: unirl-train [--recipe FILE] [--print-recipe] [key=value ...]\n\n"
                 "Trains a Hugging Face causal LM with RL (and an optional supervised stage) from a recipe\n"
                 "(JSON or YAML) and key=value overrides; docs/unirl-train.md. Ctrl-C (SIGINT) or SIGTERM stops\n"
                 "after the current step with a checkpoint (exit 130 / 143); the same command resumes.\n\n"
                 "recipe keys: key = default  [type or allowed values]\n"
              << unirl::options::help(r);
    return 0;
  }
  unirl::recipes::load(r, recipe, overrides, /*require_model=*/!print);
  if (print) {
    std::cout << unirl::options::to_json(r).dump(2) << "\n";
    return 0;
  }
  unirl::stop_request stop;
  const unirl::signal_stop_scope on_signals(stop);
  const auto res = unirl::recipes::run(r, &stop);
  std::cout << std::fixed << std::setprecision(1);
  if (res.interrupted_by != 0) {
    std::cout << "unirl-train: stopped by " << signal_name(res.interrupted_by) << " at "
              << (res.sft_steps_total < r.sft.steps ? "supervised step " + std::to_string(res.sft_steps_total)
                                                    : "step " + std::to_string(res.steps_total))
              << "; checkpoint " << (res.checkpoint.empty() ? std::string("(none: no step had finished)") : res.checkpoint)
              << "; run the same command to resume\n";
    return unirl::signal_exit_status(res.interrupted_by);
  }
  std::cout << "unirl-train: " << res.steps << " steps (from step " << res.first_step << ") in " << res.seconds
            << " s (SFT " << res.seconds_sft << " s, RL " << res.seconds_rl << " s, eval " << res.seconds_eval
            << " s); reward " << std::setprecision(3) << res.reward_first << " -> " << res.reward_last;
  if (res.accuracy_before >= 0 || res.accuracy_after >= 0)
    if (r.environment.name.empty())
      std::cout << std::setprecision(1) << "; held-out accuracy " << 100 * res.accuracy_before << "% -> "
                << 100 * res.accuracy_after << "%";
    else  // a multi-turn run: the environment's mean return over the held-out tasks
      std::cout << "; held-out mean return " << res.accuracy_before << " -> " << res.accuracy_after;
  if (!res.export_dir.empty()) std::cout << "; exported to " << res.export_dir;
  std::cout << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "unirl-train: " << e.what() << "\n";
  return 1;
}

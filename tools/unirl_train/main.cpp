// unirl-train: RL post-training of a Hugging Face causal LM from a recipe.
//
//   unirl-train --recipe recipe.yaml [key=value ...]
//   unirl-train model=path/to/hf_dir data.path=train.jsonl algorithm=dapo steps=200 out=runs/x
//   unirl-train --print-recipe [--recipe r.yaml] [key=value ...]   # the resolved recipe, as JSON
//
// Everything it does is `unirl::recipes::run` (include/unirl/recipes/token_recipe.hpp): the
// library's trainer, models, tokenizer, data and rewards; see docs/unirl-train.md.
#include <iostream>
#include <string>
#include <vector>

#include <unirl/recipes/token_recipe.hpp>

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
    r.model = "<hf model directory>";
    std::cout << "usage: unirl-train [--recipe FILE] [--print-recipe] [key=value ...]\n\nrecipe keys (defaults):\n"
              << unirl::options::to_string(r);
    return 0;
  }
  unirl::recipes::load(r, recipe, overrides);
  if (print) {
    std::cout << unirl::options::to_json(r).dump(2) << "\n";
    return 0;
  }
  const auto res = unirl::recipes::run(r);
  std::cout << "unirl-train: " << res.steps << " steps (from step " << res.first_step << ") in " << res.seconds
            << " s; reward " << res.reward_first << " -> " << res.reward_last;
  if (res.accuracy_before >= 0)
    std::cout << "; held-out accuracy " << 100 * res.accuracy_before << "% -> " << 100 * res.accuracy_after << "%";
  if (!res.export_dir.empty()) std::cout << "; exported to " << res.export_dir;
  std::cout << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "unirl-train: " << e.what() << "\n";
  return 1;
}

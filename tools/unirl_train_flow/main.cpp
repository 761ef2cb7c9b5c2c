// unirl-train-flow: Flow-GRPO post-training of a Stable Diffusion 3 pipeline in the diffusers
// layout from a recipe.
//
//   unirl-train-flow --recipe recipe.yaml [key=value ...]
//   unirl-train-flow model=path/to/sd3 prompts_file=prompts.txt steps=50 lora.rank=16 out=runs/x
//   unirl-train-flow --print-recipe [--recipe r.yaml] [key=value ...]   # the resolved recipe, as JSON
//   unirl-train-flow --help                                             # every key: type, default, meaning
//
// Everything it does is `unirl::recipes::run` (include/unirl/recipes/flow_recipe.hpp): the
// library's trainer, diffusers loader and exporter, Flow-GRPO and LoRA; see docs/unirl-train.md.
//
// Exit status: 0 done; 1 an error (naming the option or the file); 130 / 143 stopped by SIGINT /
// SIGTERM after writing a checkpoint (the same command resumes), or at once on a second signal.
#include <iomanip>
#include <iostream>
#include <string>

#include <unirl/core/command_line.hpp>
#include <unirl/core/signals.hpp>
#include <unirl/recipes/flow_recipe.hpp>

int main(int argc, char** argv) try {
  unirl::recipes::flow_recipe r;
  auto flags = unirl::options::parse_command_line(r, argc, argv, {{"print-recipe", "false"}});
  if (flags["print-recipe"] == "true") {
    std::cout << unirl::options::to_json(r).dump(2) << "\n";
    return 0;
  }
  unirl::stop_request stop;
  const unirl::signal_stop_scope on_signals(stop);
  const auto res = unirl::recipes::run(r, &stop);
  std::cout << std::fixed << std::setprecision(1);
  if (res.interrupted_by != 0) {
    std::cout << "unirl-train-flow: stopped at step " << res.steps_total << "; checkpoint "
              << (res.checkpoint.empty() ? std::string("(none: no step had finished)") : res.checkpoint)
              << "; run the same command to resume\n";
    return unirl::signal_exit_status(res.interrupted_by);
  }
  std::cout << "unirl-train-flow: " << res.steps << " steps (from step " << res.first_step << ") in " << res.seconds
            << " s; reward " << std::setprecision(4) << res.reward_first << " -> " << res.reward_last;
  if (res.eval_reward_before && res.eval_reward_after)
    std::cout << std::setprecision(6) << "; eval reward " << *res.eval_reward_before << " -> " << *res.eval_reward_after;
  std::cout << "; " << res.encoder_batches << " text-encoder batches";
  if (!res.export_dir.empty()) std::cout << "; exported to " << res.export_dir;
  std::cout << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "unirl-train-flow: " << e.what() << "\n";
  return 1;
}

// unirl_plot_metrics: plot the curves of a training run's metrics.jsonl as one PNG.
//
//   unirl_plot_metrics runs/exp1/metrics.jsonl runs/exp1/curves.png reward_mean kl grad_norm
//
// One panel per key, stacked, against "step". Without keys: reward_mean and kl.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <unirl/train/plot.hpp>

int main(int argc, char** argv) {
  const bool help = argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h");
  if (argc < 3 || help) {
    (help ? std::cout : std::cerr) << "usage: " << (argc > 0 ? argv[0] : "unirl_plot_metrics")
              << " METRICS.jsonl OUT.png [KEY...]\n"
                 "  Plots each KEY (default: reward_mean kl) of a unirl metrics file against 'step',\n"
                 "  one panel per key.\n";
    return help ? 0 : 2;
  }
  std::vector<std::string> keys(argv + 3, argv + argc);
  if (keys.empty()) keys = {"reward_mean", "kl"};
  try {
    unirl::train::plot_metrics(argv[1], argv[2], keys);
  } catch (const std::exception& e) {
    std::cerr << "unirl_plot_metrics: " << e.what() << "\n";
    return 1;
  }
  std::cout << "wrote " << argv[2] << " (" << keys.size() << (keys.size() == 1 ? " panel)\n" : " panels)\n");
  return 0;
}

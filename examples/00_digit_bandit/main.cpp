// A policy looks at real 8x8 handwritten digits and answers with a label; it learns only from a
// reward (1 for the right label), through unirl::trainer — sample, reward, group advantage,
// clipped update — with the bandit track of examples/common/bandit.hpp.
//
//   digit_bandit [--out DIR] [--recipe FILE] [key=value ...]     e.g. steps=300 trainer.optim.lr=1e-3
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <unirl/core/command_line.hpp>
#include <unirl/trainer.hpp>
#include <unirl/train/plot.hpp>
#include <unirl/train/report.hpp>

#include "common/bandit.hpp"
#include "common/digits.hpp"

using bandit_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label>;

struct example_options {
  std::int64_t steps = 200;       // trainer steps
  std::int64_t batch = 32;        // digits per step (each answered group_size times)
  std::int64_t held_out = 397;    // digits kept aside to measure accuracy
  std::int64_t hidden = 64;
  bandit_trainer::options trainer{.optim = {.lr = 3e-3},
                                  .schedule = {.kind = unirl::train::schedule_kind::cosine, .warmup_steps = 10},
                                  .clip = {.max_grad_norm = 1.0},
                                  .group_size = 8,
                                  .epochs = 2,
                                  .minibatches = 2,
                                  .seed = 1};
};
BOOST_HANA_ADAPT_STRUCT(example_options, steps, batch, held_out, hidden, trainer);

static double accuracy(bandit::model& m, const torch::Tensor& x, const torch::Tensor& y) {
  torch::NoGradGuard g;
  return (m.log_probs(x).argmax(1) == y).to(torch::kFloat64).mean().item<double>();
}

int main(int argc, char** argv) try {
  example_options opt;
  const std::string out = unirl::options::parse_command_line(opt, argc, argv, {{"out", "runs/digit_bandit"}})["out"];
  std::filesystem::create_directories(out);
  opt.trainer.total_steps = opt.steps;
  opt.trainer.metrics_path = out + "/metrics.jsonl";
  std::filesystem::remove(opt.trainer.metrics_path);
  std::cout << unirl::options::to_string(opt) << "\n";

  const auto data = examples::load_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  torch::manual_seed(0);
  const auto perm = torch::randperm(data.labels.size(0), torch::kInt64);
  const auto n = data.labels.size(0) - opt.held_out;
  const auto x = data.images.reshape({-1, 64}).index_select(0, perm);
  const auto y = data.labels.index_select(0, perm);
  const auto train_x = x.slice(0, 0, n), train_y = y.slice(0, 0, n);
  const auto test_x = x.slice(0, n), test_y = y.slice(0, n);

  torch::manual_seed(static_cast<std::uint64_t>(opt.trainer.seed));
  bandit_trainer t(bandit::model{bandit::policy_net(opt.hidden)}, {}, opt.trainer);
  const double before = accuracy(t.models().policy, test_x, test_y);
  std::cout << "held-out accuracy before RL: " << before << "\n";

  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t s = 0; s < opt.steps; ++s) {
    auto idx = torch::randint(n, {opt.batch}, torch::kInt64);
    t.step(bandit::prompts{train_x.index_select(0, idx), train_y.index_select(0, idx)});
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double after = accuracy(t.models().policy, test_x, test_y);
  std::cout << "\nheld-out accuracy after RL:  " << after << "  (" << opt.steps << " steps, " << seconds << " s)\n";

  t.save(out + "/checkpoint.pt");
  unirl::train::plot_metrics(opt.trainer.metrics_path, out + "/reward_curve.png", {"reward_mean", "entropy"});
  nlohmann::json summary{{"accuracy_before", before}, {"accuracy_after", after}, {"steps", opt.steps},
                         {"seconds", seconds}, {"options", unirl::options::to_json(opt)}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/{metrics.jsonl, reward_curve.png, summary.json, report.html, checkpoint.pt}\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 2;
}
